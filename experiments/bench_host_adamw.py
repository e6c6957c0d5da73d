# python experiments/bench_host_adamw.py --numel 134217728 --threads 16 --rounds 5 --json bench_host_adamw.json
"""The host AdamW update against torch's fused CPU AdamW and the host's own ceiling,
interleaved in one process (issue #22 item 5).

Every contender keeps its buffers for the whole run (allocated and first-touched once, by
the threads that use them) and runs at the same element and thread count. Rounds
interleave them, ``A B C A B C ...``: in each round every contender runs ``--repeats``
timed passes, after a ``--gap`` pause (torch's OpenMP workers stop spinning before the
next contender), so that drift of the machine (other tenants, frequency, a leftover
process) falls on all of them alike. The per-round ratio shows how much it moved.

Contenders (``--contenders``, comma-separated; default the first five):

* ``ceiling``: the host's read-modify-write ceiling over the update's own bytes:
  ``p``, ``m``, ``v`` read and written, ``g`` read (28 B/element; body ``x += s*g``), with
  the AdamW kernel's strips and software prefetch (:class:`_host_bench.CeilingCase`);
* ``ceiling_plain``: the same as one plain loop (no software prefetch);
* ``ours``: TrainStream's host kernel (``trainstream._host_kernels.adamw_chunk``, the
  function the engine's host placement calls), fp32, torch/cpu convention with the IEEE
  root (the arithmetic of torch's fused CPU AdamW; the row of RESULTS' 1.31x and the
  2026-12-01 run's 0.90x), one contiguous range per thread; checked bit for bit against
  the contract's reference before timing;
* ``ours_bf16``: the kernel as ``OffloadAdamW`` runs it for bf16 CUDA parameters
  (torch/cuda convention, bf16 gradient bits in, the rounded bf16 weights written back
  into the gradient buffer: also 28 B/element), checked the same way;
* ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on CPU tensors
  (``torch.set_num_threads(threads)``; ``step()`` of one fp32 parameter);
* ``torch_foreach``: ``torch.optim.AdamW(foreach=True)``;
* ``ours_mkl``: ``ours`` with the MKL square root torch's *default* CPU AdamW takes on
  this machine (what ``OffloadAdamW`` runs for CPU parameters; needs torch);
* ``rmw12``: the older yardstick ``a += s*b`` (12 B/element, prefetching).

Bytes are the fewest each must move (28 B/element for the update and ``ceiling``); GB/s =
bytes / time. Reported per contender: best and median pass, Gelem/s and GB/s of the
median, ``x torch`` (torch_fused's time / its time: > 1 is faster than torch) by median
and by best, and ``of ceiling`` (ceiling's time / its time). Target (16-core H200 host):
ours >= 1.05x torch_fused, interleaved in one run. The environment (CPU topology,
transparent huge pages, load average, Numba's target features, torch's CPU capability)
goes into the JSON and the header: the suspects of the 1.31x -> 0.90x move.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from _host_bench import (
    ADAMW_BYTES_PER_ELEMENT,
    RMW_BYTES_PER_ELEMENT,
    AdamWCase,
    CeilingCase,
    Team,
    _init_rmw,
    rmw_chunk_prefetch,
    split_ranges,
)

ALL = ("ceiling", "ceiling_plain", "ours", "ours_bf16", "torch_fused", "torch_foreach", "ours_mkl", "rmw12")
DEFAULT = "ceiling,ceiling_plain,ours,ours_bf16,torch_fused"
TORCH_ONLY = ("torch_fused", "torch_foreach", "ours_mkl")


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def environment(torch=None) -> dict:
    """What may move the ratios between machines and runs."""
    env = {"python": sys.version.split()[0], "numpy": np.__version__, "cpus": os.cpu_count(),
           "affinity": _default_threads(), "machine": platform.machine()}
    info = _read("/proc/cpuinfo") or ""
    for line in info.splitlines():
        if line.startswith("model name") and "cpu" not in env:
            env["cpu"] = line.split(":", 1)[1].strip()
        if line.startswith("cpu MHz"):
            env.setdefault("cpu_mhz", []).append(float(line.split(":", 1)[1]))
    if "cpu_mhz" in env:
        mhz = env.pop("cpu_mhz")
        env["cpu_mhz_min_max"] = [min(mhz), max(mhz)]
    siblings = _read("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    env["cpu0_thread_siblings"] = siblings
    env["numa_nodes"] = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]) \
        if os.path.isdir("/sys/devices/system/node") else None
    env["thp_enabled"] = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    env["thp_defrag"] = _read("/sys/kernel/mm/transparent_hugepage/defrag")
    env["loadavg_start"] = _read("/proc/loadavg")
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith(("MemTotal", "MemAvailable")):
            k, v = line.split(":")
            env[k] = v.strip()
    env["omp_env"] = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "MKL_", "NUMBA_"))}
    try:
        import numba

        from trainstream._jit import target_features

        import llvmlite.binding as llvm

        env["numba"] = numba.__version__
        env["numba_target_features"] = sorted(target_features())
        # the microarchitecture LLVM tunes for (a VM's masked CPUID may resolve to another)
        env["llvm_host_cpu"] = numba.config.CPU_NAME or llvm.get_host_cpu_name()
    except Exception as e:  # noqa: BLE001 - informational only
        env["numba"] = f"unavailable: {e}"
    if torch is not None:
        env["torch"] = torch.__version__
        try:
            env["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001
            pass
        env["torch_threads"] = torch.get_num_threads()
        env["torch_parallel"] = [ln.strip() for ln in torch.__config__.parallel_info().splitlines()
                                 if ln.startswith(("ATen parallel backend", "OpenMP", "MKL", "std::thread"))]
    return env


class TorchCase:
    """``torch.optim.AdamW(fused=True | foreach=True)``: one fp32 parameter of ``numel``
    elements on the CPU (state allocated by two untimed steps). Calling it runs ``step()``."""

    bytes_per_element = ADAMW_BYTES_PER_ELEMENT

    def __init__(self, torch, numel: int, impl: str):
        with torch.no_grad():
            x = torch.arange(numel, dtype=torch.float64) * 0.618
            self.p = torch.nn.Parameter(torch.sin(x).float())
            self.p.grad = torch.sin(x + 3.0).float()
            del x
        kw = {"fused": True} if impl == "fused" else {"foreach": True}
        self.opt = torch.optim.AdamW([self.p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)
        self.opt.step()  # allocates exp_avg / exp_avg_sq (first touch by torch's threads)
        self.opt.step()

    def __call__(self):
        self.opt.step()


class Rmw12Case:
    """``a += s*b`` (12 B/element), prefetching: the yardstick of the earlier runs."""

    bytes_per_element = RMW_BYTES_PER_ELEMENT

    def __init__(self, team: Team, numel: int):
        self.team, self.ranges = team, split_ranges(numel, team.threads)
        self.a, self.b = np.empty(numel, np.float32), np.empty(numel, np.float32)
        team.run(_init_rmw, self.ranges, self.a, self.b)

    def __call__(self):
        self.team.run(rmw_chunk_prefetch, self.ranges, self.a, self.b, np.float32(1e-3))


def make_case(name: str, team: Team, numel: int, torch, mkl_mode: int):
    from trainstream import contract as C
    from trainstream._host_kernels import KIND_BF16

    if name == "ceiling":
        return CeilingCase(team, numel, prefetch=True)
    if name == "ceiling_plain":
        return CeilingCase(team, numel, prefetch=False)
    if name == "ours":
        return AdamWCase(team, numel)
    if name == "ours_bf16":
        return AdamWCase(team, numel, C.VARIANT_TORCH_CUDA, KIND_BF16)
    if name == "ours_mkl":
        return AdamWCase(team, numel, sqrt_mode=mkl_mode)
    if name == "torch_fused":
        return TorchCase(torch, numel, "fused")
    if name == "torch_foreach":
        return TorchCase(torch, numel, "foreach")
    if name == "rmw12":
        return Rmw12Case(team, numel)
    raise ValueError(f"unknown contender {name!r} (known: {', '.join(ALL)})")


def summarize(names, times, numel) -> dict:
    """Per contender: best/median ms, Gelem/s and GB/s of the median, ratios to torch_fused
    and to the ceiling (by time: both move 28 B/element), per-round medians."""
    out = {}
    med = {n: statistics.median(t for r in times[n] for t in r) for n in names}
    best = {n: min(t for r in times[n] for t in r) for n in names}
    for n in names:
        bpe = times["_bpe"][n]
        r = {"ms_best": 1e3 * best[n], "ms_median": 1e3 * med[n], "gbps_median": numel * bpe / med[n] / 1e9,
             "gbps_best": numel * bpe / best[n] / 1e9, "bytes_per_element": bpe,
             "round_medians_ms": [1e3 * statistics.median(r) for r in times[n]]}
        if bpe == ADAMW_BYTES_PER_ELEMENT and not n.startswith("ceiling"):
            r["gelems_per_s_median"] = numel / med[n] / 1e9
            r["gelems_per_s_best"] = numel / best[n] / 1e9
        if "torch_fused" in names and bpe == ADAMW_BYTES_PER_ELEMENT:
            r["x_torch_median"] = med["torch_fused"] / med[n]
            r["x_torch_best"] = best["torch_fused"] / best[n]
            r["x_torch_per_round"] = [statistics.median(a) / statistics.median(b)
                                      for a, b in zip(times["torch_fused"], times[n])]
        if "ceiling" in names:
            r["of_ceiling_median"] = (numel * bpe / med[n]) / (numel * ADAMW_BYTES_PER_ELEMENT / med["ceiling"])
        out[n] = r
    return out


def main(argv=None) -> int:
    big = (os.cpu_count() or 1) >= 8
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2**27 if big else 2**22,
                    help="elements per buffer (default 2**27 with >= 8 CPUs, else 2**22)")
    ap.add_argument("--threads", type=int, default=_default_threads(),
                    help="threads for every contender (default: the CPUs this process may use)")
    ap.add_argument("--contenders", default=DEFAULT, help=f"comma list of {', '.join(ALL)}")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B C A B C ...)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per contender per round")
    ap.add_argument("--gap", type=float, default=0.2, help="seconds of pause before each contender's passes")
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch contenders")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if min(args.numel, args.threads, args.repeats, args.rounds) < 1 or args.gap < 0:
        ap.error("--numel, --threads, --repeats and --rounds must be >= 1, --gap >= 0")
    names = [n for n in args.contenders.split(",") if n]
    for n in names:
        if n not in ALL:
            ap.error(f"unknown contender {n!r} (known: {', '.join(ALL)})")
    torch = None
    if not args.no_torch and any(n in TORCH_ONLY for n in names):
        try:
            import torch
        except ImportError:
            print("torch not installed: torch contenders left out", file=sys.stderr)
    if torch is None:
        names = [n for n in names if n not in TORCH_ONLY]
    else:
        torch.set_num_threads(args.threads)
    mkl_mode = 0
    if "ours_mkl" in names:
        from trainstream.backends.torch import torch_cpu_code

        mkl_mode = torch_cpu_code()
    env = environment(torch)
    n, t = args.numel, args.threads
    print(f"# {env.get('cpu')}, {env['cpus']} CPUs (cpu0 siblings {env['cpu0_thread_siblings']}, "
          f"NUMA nodes {env['numa_nodes']}), THP {env['thp_enabled']}, load {env['loadavg_start']}; "
          f"numba {env.get('numba')} {env.get('llvm_host_cpu')} {env.get('numba_target_features')}, torch {env.get('torch', '-')} "
          f"{env.get('torch_cpu_capability', '')}")
    print(f"# numel={n}, threads={t}, {args.rounds} interleaved rounds x {args.repeats} passes, "
          f"gap {args.gap} s; contenders {', '.join(names)}", flush=True)

    times: dict = {name: [] for name in names}
    times["_bpe"] = {}
    t_setup = time.perf_counter()
    with Team(t) as team:
        cases = {}
        for name in names:
            cases[name] = make_case(name, team, n, torch, mkl_mode)
            times["_bpe"][name] = cases[name].bytes_per_element
        print(f"# buffers allocated, first-touched and checked in {time.perf_counter() - t_setup:.1f} s", flush=True)
        for rnd in range(args.rounds):
            for name in names:
                time.sleep(args.gap)
                case, rt = cases[name], []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    case()
                    rt.append(time.perf_counter() - t0)
                times[name].append(rt)
            line = "  ".join(f"{name} {n * times['_bpe'][name] / statistics.median(times[name][-1]) / 1e9:6.1f}"
                             for name in names)
            print(f"round {rnd + 1}: GB/s (median pass) {line}", flush=True)
        del cases
    res = summarize(names, times, n)

    header = (f"{'contender':<14} {'ms best':>8} {'ms med':>8} {'Gelem/s':>8} {'GB/s':>7} "
              f"{'x torch med':>11} {'x torch best':>12} {'of ceiling':>10}")
    print(header)
    print("-" * len(header))

    def f(x, w, p):
        return f"{x:{w}.{p}f}" if x is not None else " " * w

    for name in names:
        r = res[name]
        print(f"{name:<14} {r['ms_best']:8.2f} {r['ms_median']:8.2f} {f(r.get('gelems_per_s_median'), 8, 3)} "
              f"{r['gbps_median']:7.1f} {f(r.get('x_torch_median'), 11, 3)} {f(r.get('x_torch_best'), 12, 3)} "
              f"{f(r.get('of_ceiling_median'), 10, 3)}")
    summary = {}
    if "ours" in res and "torch_fused" in res:
        o = res["ours"]
        summary.update(ours_x_torch_median=o["x_torch_median"], ours_x_torch_best=o["x_torch_best"],
                       ours_x_torch_per_round=o["x_torch_per_round"])
    for name in ("ours", "ours_bf16", "torch_fused", "ceiling_plain"):
        if name in res and "of_ceiling_median" in res[name]:
            summary[f"{name}_of_ceiling"] = res[name]["of_ceiling_median"]
    if "ours" in summary or "ours_x_torch_median" in summary:
        pr = summary.get("ours_x_torch_per_round", [])
        print(f"ours / torch fused: {summary['ours_x_torch_median']:.3f}x (median passes; best {summary['ours_x_torch_best']:.3f}x; "
              f"per round {min(pr):.3f}-{max(pr):.3f}); target >= 1.05x")
    print("of the ceiling (28 B/element stream, median): " +
          ", ".join(f"{k[:-11]} {v:.3f}" for k, v in summary.items() if k.endswith("_of_ceiling")))
    env["loadavg_end"] = _read("/proc/loadavg")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "args": vars(args), "results": res, "summary": summary,
                       "times_s": {k: v for k, v in times.items() if k != "_bpe"}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
