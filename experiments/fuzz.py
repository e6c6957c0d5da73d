# Run: python experiments/fuzz.py --adapter torch --examples 10000 [--seed 0] [--jobs N] [--pending] [--full] [--json out.json]
"""The longer run of the differential fuzzers of issue 40 item 5 (tests/_fuzz_torch.py, tests/_fuzz_jax.py; CI runs
a few hundred derandomized sequences of each in tests/test_fuzz_*.py): ``--examples`` random sequences, each run
against the reference (torch.optim.AdamW/Adam for ``--adapter torch``; optax.adamw/adam for ``--adapter jax``) and
classified. Prints the counts: sequences run, bit-identical, both raised, ours refused (by reason), warned (JAX: the
documented ULP bound), silent differences and other findings (both must be 0; each one found is printed with its
sequence, and the exit status is 1).

``--pending`` (torch) adds the operations of ``_fuzz_torch.PENDING`` (known defects, left out of CI until fixed);
``--full`` (JAX) adds the hyper-parameters whose Numba kernels no CI test compiles (a cold cache compiles each once,
5-50 s). ``--seed`` makes the run repeatable. ``--jobs N`` splits the examples over N processes (process i draws
with seed ``seed + i``) and adds their counts up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st  # noqa: E402


def _torch_property(args, counts, findings):
    import _fuzz_torch as F  # noqa: PLC0415

    @given(cfg=F.configs(), ops=F.sequences(pending=args.pending))
    def run(cfg, ops):
        _progress(counts)
        try:
            F.tally(counts, *F.run_sequence(cfg, ops))
        except F.Finding as exc:
            _found(counts, findings, exc, isinstance(exc, F.SilentDifference), dict(cfg=cfg, ops=ops))
    return run


def _jax_property(args, counts, findings):
    import os  # noqa: PLC0415
    if args.full:
        os.environ["TRAINSTREAM_FUZZ_FULL"] = "1"
    import _fuzz_jax as F  # noqa: PLC0415
    import jax  # noqa: PLC0415

    @given(cfg=F.configs(args.full), tree=F.trees(), steps=st.integers(1, 3), scales=F.scales(),
           mismatch=F.mismatches())
    def run(cfg, tree, steps, scales, mismatch):
        _progress(counts)
        if counts["_seen"] % 100 == 0:  # each sequence compiles its own programs: JAX keeps every executable
            jax.clear_caches()  # alive (about 3 memory mappings each, with optax alone too) until the process
            # reaches vm.max_map_count and XLA:CPU's JIT aborts ("Unable to allocate section memory", ~2,500
            # sequences); clearing holds the mappings flat (experiments/RESULTS.md, session p)
        try:
            F.tally(counts, *F.run_sequence(cfg, tree, steps, scales, mismatch))
        except F.Finding as exc:
            _found(counts, findings, exc, isinstance(exc, F.SilentDifference),
                   dict(cfg=cfg, tree=tree, steps=steps, scales=scales, mismatch=mismatch))
    return run


def _progress(counts, every: int = 250) -> None:
    """A line of counts every ``every`` sequences (a long run shows where it stands)."""
    n = counts["_seen"] = counts["_seen"] + 1
    if n % every == 0:
        top = {k: v for k, v in counts.items() if ":" not in k and k != "_seen"}
        print(f"[{n}] {top}", flush=True)


def _found(counts, findings, exc, silent, case):
    counts["silent difference" if silent else "other finding"] += 1
    findings.append((str(exc), case))
    if len(findings) <= 5:
        print(f"FINDING: {exc}\n  {case}", flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", choices=("torch", "jax"), required=True)
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pending", action="store_true", help="torch: include the PENDING operations")
    ap.add_argument("--full", action="store_true", help="jax: every hyper-parameter family")
    ap.add_argument("--json", type=Path, default=None, help="write the counts here")
    ap.add_argument("--jobs", type=int, default=1, help="processes (process i: seed + i)")
    args = ap.parse_args(argv)
    if args.jobs > 1:
        return _sharded(args, argv if argv is not None else sys.argv[1:])
    counts, findings = Counter(), []
    prop = (_torch_property if args.adapter == "torch" else _jax_property)(args, counts, findings)
    run = settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
                   suppress_health_check=list(HealthCheck))(seed(args.seed)(prop))
    t0 = time.perf_counter()
    run()
    elapsed = time.perf_counter() - t0
    main_keys = ("identical", "warned identical", "both raised", "refused", "config refused", "warned",
                 "mismatch refused", "mismatch identical", "silent difference", "other finding")
    total = sum(counts[k] for k in main_keys)
    print(f"\n# python experiments/fuzz.py --adapter {args.adapter} --examples {args.examples} --seed {args.seed}"
          f"{' --pending' if args.pending else ''}{' --full' if args.full else ''}  ({elapsed:.0f} s)")
    print(f"sequences run: {total}")
    for k in main_keys:
        print(f"  {k}: {counts[k]}")
    print("by reason:")
    for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if k not in main_keys and k != "_seen":
            print(f"  {v:6d}  {k}")
    result = {"adapter": args.adapter, "examples": args.examples, "seed": args.seed, "pending": args.pending,
              "full": args.full, "seconds": round(elapsed, 1), "sequences": total, "counts": dict(counts),
              "findings": [f for f, _ in findings[:50]]}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def _sharded(args, argv) -> dict:
    """``--jobs N``: N processes of this script, process i with seed ``seed + i`` and its share of the examples;
    their counts and findings added up, printed and written as one run's."""
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    t0 = time.perf_counter()
    rest = [a for i, a in enumerate(argv) if a not in ("--jobs", "--seed", "--examples", "--json")
            and (i == 0 or argv[i - 1] not in ("--jobs", "--seed", "--examples", "--json"))]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(args.jobs):
            n = args.examples // args.jobs + (i < args.examples % args.jobs)
            cmd = [sys.executable, __file__, *rest, "--examples", str(n), "--seed", str(args.seed + i),
                   "--json", f"{tmp}/{i}.json"]
            procs.append(subprocess.Popen(cmd, stdout=open(f"{tmp}/{i}.log", "w"), stderr=subprocess.STDOUT))
        for p in procs:
            p.wait()
        parts = [json.loads(Path(f"{tmp}/{i}.json").read_text()) if Path(f"{tmp}/{i}.json").exists()
                 else {"counts": {"other finding": 1}, "findings": [Path(f"{tmp}/{i}.log").read_text()[-3000:]]}
                 for i in range(args.jobs)]
    counts = Counter()
    for part in parts:
        counts.update(part["counts"])
    counts.pop("_seen", None)
    result = {"adapter": args.adapter, "examples": args.examples, "seed": args.seed, "jobs": args.jobs,
              "pending": args.pending, "full": args.full, "seconds": round(time.perf_counter() - t0, 1),
              "sequences": sum(p.get("sequences", 0) for p in parts), "counts": dict(counts),
              "findings": [f for p in parts for f in p["findings"]][:50]}
    print(f"# python experiments/fuzz.py --adapter {args.adapter} --examples {args.examples} --seed {args.seed} "
          f"--jobs {args.jobs}{' --pending' if args.pending else ''}{' --full' if args.full else ''}  "
          f"({result['seconds']:.0f} s)\nsequences run: {result['sequences']}")
    for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {v:6d}  {k}")
    for f in result["findings"][:5]:
        print(f"FINDING: {f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(1 if out["counts"].get("silent difference") or out["counts"].get("other finding") else 0)
