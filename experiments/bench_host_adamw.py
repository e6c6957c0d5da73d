# Run: python experiments/bench_host_adamw.py --numel 134217728 --threads 16 --rounds 5 --repeats 5 --json $OUT/bench_host.json
"""The host AdamW update against torch's fused CPU AdamW and the host's own ceiling,
interleaved in one process.

Every contender keeps its buffers for the whole run (``_host_bench.py``) and runs at the
same element and thread count. Rounds interleave them, ``A B C A B C ...``: in each round
every contender runs ``--repeats`` timed passes after a ``--gap`` pause (torch's OpenMP
workers stop spinning), so that drift of the shared machine falls on all of them alike.

Contenders (``--contenders``; default the first five): ``ceiling`` (read-modify-write over the
update's 28 B/element, prefetching), ``ceiling_plain`` (the same, one plain loop), ``ours``
(the engine's host kernel, fp32, torch/cpu convention with the IEEE root: the arithmetic of
torch's fused CPU AdamW), ``ours_bf16`` (the kernel as ``OffloadAdamW`` runs it for bf16
CUDA parameters), ``torch_fused`` / ``torch_foreach`` (``torch.optim.AdamW`` on one fp32 CPU
parameter, ``torch.set_num_threads(threads)``), ``ours_mkl`` (``ours`` with the MKL root of
torch's default CPU AdamW on this host) and ``rmw12`` (``a += s*b``, 12 B/element).
Reported per contender: best and median pass, GB/s, ``x torch`` (torch_fused's time / its
time) and ``of ceiling`` (ceiling's time / its time). Target (H200 host): ours >= 1.05x
torch_fused. The environment (CPU, huge pages, load, Numba's target, torch's CPU
capability) goes into the JSON: what moves the ratios between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host_bench import ADAMW_BYTES_PER_ELEMENT, AdamWCase, CeilingCase, RmwCase, Team  # noqa: E402

ALL = ("ceiling", "ceiling_plain", "ours", "ours_bf16", "torch_fused", "torch_foreach", "ours_mkl", "rmw12")
DEFAULT = "ceiling,ceiling_plain,ours,ours_bf16,torch_fused"
TORCH_ONLY = ("torch_fused", "torch_foreach", "ours_mkl")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def environment(torch=None) -> dict:
    """What may move the ratios between machines and runs."""
    env = {"python": sys.version.split()[0], "numpy": np.__version__, "cpus": os.cpu_count(),
           "cpu": next((ln.split(":", 1)[1].strip() for ln in (_read("/proc/cpuinfo") or "").splitlines()
                        if ln.startswith("model name")), None),
           "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"), "loadavg_start": _read("/proc/loadavg")}
    try:
        import numba

        from trainstream._jit import target_features

        env.update(numba=numba.__version__, numba_target_features=sorted(target_features()))
    except Exception as e:  # noqa: BLE001 - informational only
        env["numba"] = f"unavailable: {e}"
    if torch is not None:
        env.update(torch=torch.__version__, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   torch_threads=torch.get_num_threads())
    return env


class TorchCase:
    """``torch.optim.AdamW(fused=True | foreach=True)`` on one fp32 CPU parameter of ``numel``
    elements (state allocated by two untimed steps). Calling it runs ``step()``."""

    bytes_per_element = ADAMW_BYTES_PER_ELEMENT

    def __init__(self, torch, numel: int, impl: str):
        with torch.no_grad():
            x = torch.arange(numel, dtype=torch.float64) * 0.618
            self.p = torch.nn.Parameter(torch.sin(x).float())
            self.p.grad = torch.sin(x + 3.0).float()
        self.opt = torch.optim.AdamW([self.p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **{impl: True})
        self.opt.step()
        self.opt.step()

    def __call__(self):
        self.opt.step()


def make_case(name: str, team: Team, numel: int, torch):
    from trainstream import contract as C
    from trainstream._host_kernels import KIND_BF16

    if name.startswith("torch_"):
        return TorchCase(torch, numel, name[6:])
    if name == "ours_mkl":
        from trainstream.backends.torch import torch_cpu_code

        return AdamWCase(team, numel, sqrt_mode=torch_cpu_code())
    return {"ceiling": lambda: CeilingCase(team, numel), "ceiling_plain": lambda: CeilingCase(team, numel, False),
            "ours": lambda: AdamWCase(team, numel), "ours_bf16": lambda: AdamWCase(team, numel, C.VARIANT_TORCH_CUDA, KIND_BF16),
            "rmw12": lambda: RmwCase(team, numel)}[name]()


def summarize(names, times, bpe, numel) -> dict:
    """Per contender: best/median ms, GB/s, ratios to torch_fused and to the ceiling (by
    time: both move 28 B/element), per-round medians."""
    out = {}
    med = {n: statistics.median(t for r in times[n] for t in r) for n in names}
    best = {n: min(t for r in times[n] for t in r) for n in names}
    for n in names:
        r = {"ms_best": 1e3 * best[n], "ms_median": 1e3 * med[n], "gbps_median": numel * bpe[n] / med[n] / 1e9,
             "bytes_per_element": bpe[n], "round_medians_ms": [1e3 * statistics.median(r) for r in times[n]]}
        if bpe[n] == ADAMW_BYTES_PER_ELEMENT and "torch_fused" in names:
            r["x_torch_median"] = med["torch_fused"] / med[n]
            r["x_torch_best"] = best["torch_fused"] / best[n]
            r["x_torch_per_round"] = [statistics.median(a) / statistics.median(b)
                                      for a, b in zip(times["torch_fused"], times[n])]
        if "ceiling" in names:
            r["of_ceiling_median"] = (numel * bpe[n] / med[n]) / (numel * ADAMW_BYTES_PER_ELEMENT / med["ceiling"])
        out[n] = r
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2**27 if (os.cpu_count() or 1) >= 8 else 2**22,
                    help="elements per buffer (default 2**27 with >= 8 CPUs, else 2**22)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: the CPUs this process may use")
    ap.add_argument("--contenders", default=DEFAULT, help=f"comma list of {', '.join(ALL)}")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B C A B C ...)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per contender per round")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds of pause before each contender's passes")
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch contenders")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    names = [n for n in args.contenders.split(",") if n]
    if min(args.numel, args.threads, args.repeats, args.rounds) < 1 or args.gap < 0 or not set(names) <= set(ALL):
        ap.error(f"--numel, --threads, --repeats, --rounds >= 1, --gap >= 0, --contenders some of {', '.join(ALL)}")
    torch = None
    if not args.no_torch and set(names) & set(TORCH_ONLY):
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            print("torch not installed: torch contenders left out", file=sys.stderr)
    names = [n for n in names if torch is not None or n not in TORCH_ONLY]
    env, n = environment(torch), args.numel
    print(f"# {env}\n# numel={n}, threads={args.threads}, {args.rounds} rounds x {args.repeats} passes, "
          f"gap {args.gap} s", flush=True)
    times = {name: [] for name in names}
    with Team(args.threads) as team:
        cases = {name: make_case(name, team, n, torch) for name in names}
        bpe = {name: c.bytes_per_element for name, c in cases.items()}
        for rnd in range(args.rounds):
            for name in names:
                time.sleep(args.gap)
                rt = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    cases[name]()
                    rt.append(time.perf_counter() - t0)
                times[name].append(rt)
            print(f"round {rnd + 1}: GB/s (median pass) " + "  ".join(
                f"{k} {n * bpe[k] / statistics.median(times[k][-1]) / 1e9:6.1f}" for k in names), flush=True)
        del cases
    res = summarize(names, times, bpe, n)
    print(f"{'contender':<14} {'ms best':>8} {'ms med':>8} {'GB/s':>7} {'x torch med':>11} {'x torch best':>12} {'of ceiling':>10}")
    for name, r in res.items():
        cells = [f"{r[k]:{w}.3f}" if k in r else " " * w for k, w in
                 (("x_torch_median", 11), ("x_torch_best", 12), ("of_ceiling_median", 10))]
        print(f"{name:<14} {r['ms_best']:8.2f} {r['ms_median']:8.2f} {r['gbps_median']:7.1f} " + " ".join(cells))
    summary = {f"{k}_of_ceiling": res[k]["of_ceiling_median"] for k in res if "of_ceiling_median" in res[k]}
    if "ours" in res and "torch_fused" in res:
        o = res["ours"]
        summary.update(ours_x_torch_median=o["x_torch_median"], ours_x_torch_best=o["x_torch_best"],
                       ours_x_torch_per_round=o["x_torch_per_round"])
        print(f"ours / torch fused: {o['x_torch_median']:.3f}x (median; best {o['x_torch_best']:.3f}x; per round "
              f"{min(o['x_torch_per_round']):.3f}-{max(o['x_torch_per_round']):.3f}); target >= 1.05x")
    env["loadavg_end"] = _read("/proc/loadavg")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "args": vars(args), "results": res, "summary": summary, "times_s": times}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
