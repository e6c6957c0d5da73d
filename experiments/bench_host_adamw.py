# python experiments/bench_host_adamw.py --numel 134217728 --threads 16 --json bench_host_adamw.json
"""The host AdamW update beside torch's CPU AdamW, and the machine's in-place bandwidth.

In one process, with the same element count and thread count for all:

* ``trainstream``: :func:`_host_bench.benchmark_host_adamw` (fp32, torch/cpu
  convention with the IEEE square root, as torch's fused CPU AdamW and every CUDA
  convention use; one contiguous range per thread of a persistent pool; checked against
  the contract's reference before timing);
* ``ts torch-sqrt``: the same with the square root torch's *default* CPU AdamW takes on
  this machine (MKL's ``vsSqrt``, emulated; taken 16 lanes at a time), i.e. what
  ``OffloadAdamW`` runs for CPU parameters;
* ``torch fused``: ``torch.optim.AdamW(fused=True)`` on CPU tensors
  (``torch.set_num_threads(threads)``);
* ``torch foreach``: ``torch.optim.AdamW(foreach=True)``;
* ``rmw stream``: ``a[i] += s*b[i]`` in place (12 bytes/element), the bandwidth an
  in-place update can reach, with the AdamW kernel's software prefetch (the yardstick:
  "of RMW" divides by it); ``rmw plain``: the same loop without prefetch, for reference.

Bytes are counted as the fewest the update must move: 28 per element (read p, m, v, g;
write p, m, v) for all three optimizers. Targets (16-core H200 host): trainstream
>= 1.05x torch fused, and >= 0.93 of the read-modify-write bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from _host_bench import (
    ADAMW_BYTES_PER_ELEMENT,
    benchmark_host_adamw,
    benchmark_rmw_bandwidth,
)


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bench_torch_adamw(numel: int, threads: int, impl: str, repeats: int) -> dict:
    """Best of ``repeats`` ``step()`` calls of torch.optim.AdamW(``impl``) on CPU tensors."""
    import torch

    torch.set_num_threads(threads)
    with torch.no_grad():
        x = torch.arange(numel, dtype=torch.float64) * 0.618
        p = torch.nn.Parameter(torch.sin(x).float())
        p.grad = torch.sin(x + 3.0).float()
        del x
    kw = {"fused": True} if impl == "fused" else {"foreach": True}
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)
    opt.step()  # allocates exp_avg / exp_avg_sq (first touch), warms up
    opt.step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    del opt, p
    return {
        "ms": best * 1e3,
        "gelems_per_s": numel / best / 1e9,
        "gbps": numel * ADAMW_BYTES_PER_ELEMENT / best / 1e9,
        "threads": threads,
        "numel": numel,
    }


def main(argv=None) -> int:
    big = (os.cpu_count() or 1) >= 8
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2**27 if big else 2**24,
                    help="elements per tensor (default 2**27 with >= 8 CPUs, else 2**24)")
    ap.add_argument("--threads", type=int, default=_default_threads(),
                    help="threads for every contender (default: the CPUs this process may use)")
    ap.add_argument("--repeats", type=int, default=10, help="timed repetitions; the best is kept")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole comparison this many times; the best of each is kept")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch contenders")
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.threads < 1 or args.repeats < 1 or args.rounds < 1:
        ap.error("--numel, --threads, --repeats and --rounds must be >= 1")

    import numba

    env = {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba.__version__,
    }
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("torch not installed: torch contenders skipped", file=sys.stderr)
        else:
            env["torch"] = torch.__version__
    print(f"# {env['cpu']}, {env['cpus']} CPUs; numel={args.numel}, threads={args.threads}, "
          f"best of {args.repeats} x {args.rounds} round(s); " +
          ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("cpu", "cpus")))

    results: dict[str, dict] = {}

    def keep(name, r):
        if name not in results or r["ms"] < results[name]["ms"]:
            results[name] = r

    n, t = args.numel, args.threads
    mkl_mode = 0
    if torch is not None:
        from trainstream.torch._backend import torch_cpu_code

        mkl_mode = torch_cpu_code()
    for _ in range(args.rounds):
        gbps = benchmark_rmw_bandwidth(n, t, repeats=args.repeats, prefetch=True)
        keep("rmw stream", {"ms": n * 12 / gbps / 1e6, "gbps": gbps, "threads": t, "numel": n})
        gbps = benchmark_rmw_bandwidth(n, t, repeats=args.repeats, prefetch=False)
        keep("rmw plain", {"ms": n * 12 / gbps / 1e6, "gbps": gbps, "threads": t, "numel": n})
        keep("trainstream", benchmark_host_adamw(n, t, repeats=args.repeats))
        if torch is not None and mkl_mode:  # the root torch's default CPU AdamW takes here
            keep("ts torch-sqrt", benchmark_host_adamw(n, t, repeats=args.repeats, sqrt_mode=mkl_mode))
        if torch is not None:
            keep("torch fused", bench_torch_adamw(n, t, "fused", args.repeats))
            keep("torch foreach", bench_torch_adamw(n, t, "foreach", args.repeats))
            time.sleep(0.5)  # let torch's OpenMP workers stop spinning before the next round

    rmw = results["rmw stream"]["gbps"]
    fused = results.get("torch fused")
    header = f"{'contender':<14} {'ms':>9} {'Gelem/s':>8} {'GB/s':>7} {'x fused':>8} {'of RMW':>7}"
    print(header)
    print("-" * len(header))
    for name in ("trainstream", "ts torch-sqrt", "torch fused", "torch foreach", "rmw stream", "rmw plain"):
        r = results.get(name)
        if r is None:
            continue
        ge = f"{r['gelems_per_s']:8.3f}" if "gelems_per_s" in r else f"{'':8}"
        xf = f"{r['gelems_per_s'] / fused['gelems_per_s']:8.3f}" if fused and "gelems_per_s" in r else f"{'':8}"
        r["of_rmw"] = r["gbps"] / rmw
        print(f"{name:<14} {r['ms']:9.3f} {ge} {r['gbps']:7.1f} {xf} {r['of_rmw']:7.3f}")
    ours = results["trainstream"]
    summary = {"of_rmw": ours["gbps"] / rmw}
    if fused:
        summary["x_fused"] = ours["gelems_per_s"] / fused["gelems_per_s"]
    print("targets (16-core H200 host): x fused >= 1.05, of RMW >= 0.93; here: "
          + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "args": vars(args), "results": results, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
