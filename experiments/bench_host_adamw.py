# Run: python experiments/bench_host_adamw.py --numel 134217728 --threads 16 --rounds 5 --repeats 5 --json $OUT/bench_host.json
"""The host AdamW update against torch's fused CPU AdamW and the host's own ceiling,
interleaved in one process.

Every contender keeps its buffers for the whole run (allocated and first-touched by the
threads that use them) and runs one full pass over ``--numel`` elements per call, split into
one contiguous range per thread of a shared :class:`Team` (the kernels release the GIL).
Rounds interleave the contenders, ``A B C A B C ...``: in each round every contender runs
``--repeats`` timed passes after a ``--gap`` pause (torch's OpenMP workers stop spinning), so
that drift of the shared machine falls on all of them alike.

Contenders (``--contenders``; default the first five), all moving 28 B/element:
``ceiling`` (:class:`CeilingCase`: ``p``, ``m``, ``v`` read and written, ``g`` read, body
``x += s*g``, with the AdamW kernel's strips and software prefetch), ``ceiling_plain`` (the
same, one plain loop), ``ours`` (:class:`AdamWCase`: ``trainstream._host_kernels.adamw_chunk``,
the function the engine's host placement calls, fp32, torch/cpu convention with the IEEE root:
the arithmetic of torch's fused CPU AdamW), ``ours_bf16`` (the kernel as ``OffloadAdamW`` runs
it for bf16 CUDA parameters), ``torch_fused`` / ``torch_foreach`` (``torch.optim.AdamW`` on one
fp32 CPU parameter, ``torch.set_num_threads(threads)``). Each case checks its first pass (the
kernels bit for bit against the contract's reference) before it is timed.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from numba import njit

from trainstream import contract as C
from trainstream._host_kernels import KIND_BF16, KIND_F32, _AHEAD, _LINE, _STRIP, _prefetch_r, _prefetch_w, adamw_chunk
from trainstream._jit import OPTS as _JIT_OPTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_name  # noqa: E402

ALL = ("ceiling", "ceiling_plain", "ours", "ours_bf16", "torch_fused", "torch_foreach")
DEFAULT = "ceiling,ceiling_plain,ours,ours_bf16,torch_fused"
BYTES_PER_ELEMENT = 28  # the fewest the update must move: p, m, v read and written, g read
_ALIGN = 16  # range boundaries on 64-byte lines of float32
_NJIT = dict(_JIT_OPTS, cache=False, boundscheck=False)  # loaded from its file: no disk cache


def split_ranges(numel: int, parts: int, align: int = _ALIGN) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, numel)``, boundaries multiples of ``align``."""
    bounds = [min(numel, (numel * k // parts) // align * align) for k in range(parts + 1)]
    bounds[-1] = numel
    return list(zip(bounds[:-1], bounds[1:]))


class Team:
    """``threads`` workers: ``threads - 1`` pool threads plus the calling thread."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, "ts-bench") if threads > 1 else None

    def run(self, fn, ranges, *args):
        """``fn(*args, begin, end)`` for each range, in parallel; returns when all are done."""
        futures = [self._pool.submit(fn, *args, b, e) for b, e in ranges[1:]] if self._pool else []
        fn(*args, *ranges[0])
        for f in futures:
            f.result()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown()


def _init(*arrays_and_range):
    """Deterministic, normal-range values (first touch by the thread that will use them)."""
    *arrays, b, e = arrays_and_range
    x = np.arange(b, e, dtype=np.float64) * 0.618
    for k, a in enumerate(arrays):
        a[b:e] = np.sin(x + k) * (0.01 if k == 2 else 1.0) + (0.01 if k == 2 else 0.0)  # v (k = 2) positive


def _sample(numel: int, ranges) -> np.ndarray:
    """Every range boundary and random interior elements."""
    edges = [x for b, e in ranges for x in (b, e - 1)]
    return np.unique(np.concatenate([edges, np.random.default_rng(0).integers(0, numel, min(numel, 65536))]))


@njit(**_NJIT)
def ceiling_chunk(p, m, v, g, s, begin, end):
    """The update's memory traffic with a trivial body, strips and software prefetch."""
    stop, lo = np.uint64(end), np.uint64(begin)
    while lo < stop:
        hi = min(lo + _STRIP, stop)
        for q in range(np.uint64(0), _STRIP, _LINE):
            j = lo + _AHEAD + q
            _prefetch_w(p, j)
            _prefetch_w(m, j)
            _prefetch_w(v, j)
            _prefetch_r(g, j)
        for i in range(lo, hi):
            gi = s * g[i]
            p[i] = p[i] + gi
            m[i] = m[i] + gi
            v[i] = v[i] + gi
        lo = hi


@njit(**_NJIT)
def ceiling_chunk_plain(p, m, v, g, s, begin, end):
    """:func:`ceiling_chunk` as one plain loop."""
    for i in range(np.uint64(begin), np.uint64(end)):
        gi = s * g[i]
        p[i] = p[i] + gi
        m[i] = m[i] + gi
        v[i] = v[i] + gi


class CeilingCase:
    """The host's read-modify-write ceiling over the update's own bytes (float32 ``p``, ``m``,
    ``v`` += ``s * g``), with prefetch or as one plain loop; checked on a sample once."""

    def __init__(self, team: Team, numel: int, prefetch: bool = True):
        self.team, self.kernel, self.s = team, ceiling_chunk if prefetch else ceiling_chunk_plain, np.float32(1e-3)
        self.ranges = split_ranges(numel, team.threads)
        self.bufs = tuple(np.empty(numel, np.float32) for _ in range(4))
        team.run(_init, self.ranges, *self.bufs)
        idx = _sample(numel, self.ranges)
        want = [a[idx] + self.s * self.bufs[-1][idx] for a in self.bufs[:-1]]
        self()
        if not all(np.array_equal(a[idx], w) for a, w in zip(self.bufs, want)):
            raise RuntimeError("the ceiling kernel gave wrong values; not timing it")

    def __call__(self):
        self.team.run(self.kernel, self.ranges, *self.bufs, self.s)


def _adamw_range(p, m, v, g, out, okind, variant, gkind, s, begin, end):
    adamw_chunk(variant, p, m, v, g, gkind, out, okind, begin, end, s)


def _to_bf16_range(src, dst, b, e):
    dst[b:e] = C.f32_to_bf16_bits(src[b:e])


class AdamWCase:
    """The host update: fp32 gradient and weights, torch/cpu convention (IEEE root: torch's fused
    CPU AdamW's arithmetic), or ``bf16``: the torch/cuda convention on bf16 gradient bits with the
    rounded bf16 weights written back into the gradient buffer, as the engine runs bf16 CUDA
    parameters (also 28 B/element). The first update is checked bit for bit on a sample against
    the contract's reference (``RuntimeError`` otherwise); calling the case runs one update with
    the scalars of step 11, unclipped."""

    def __init__(self, team: Team, numel: int, bf16: bool = False):
        self.team, self.ranges = team, split_ranges(numel, team.threads)
        p, m, v, g = (np.empty(numel, np.float32) for _ in range(4))
        team.run(_init, self.ranges, p, m, v, g)
        out, self.gkind = None, KIND_BF16 if bf16 else KIND_F32
        if bf16:
            out = np.empty(numel, np.uint16)
            team.run(_to_bf16_range, self.ranges, g, out)
            g = out  # the weights into the gradient buffer
        self.args = (p, m, v, g, out, self.gkind, C.VARIANT_TORCH_CUDA if bf16 else C.VARIANT_TORCH_CPU, self.gkind)
        conv = ("torch", "cuda" if bf16 else "cpu")
        hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
        s = C.step_scalars(hp, 10, *conv, clip=1.0 if bf16 else 0.75)
        self.s = C.step_scalars(hp, 11, *conv, clip=1.0)
        idx = _sample(numel, self.ranges)
        gs = C.bf16_bits_to_f32(g[idx]) if bf16 else g[idx]
        want = list(C.reference_update(p[idx], m[idx], v[idx], gs, s, *conv, grad_dtype="bfloat16" if bf16 else "float32"))
        team.run(_adamw_range, self.ranges, *self.args, s)
        got = [p[idx], m[idx], v[idx]] + ([g[idx]] if bf16 else [])
        want += [C.f32_to_bf16_bits(want[0])] if bf16 else []
        for name, a, w in zip(("p", "m", "v", "bf16 weights"), got, want):
            a, w = np.asarray(a), np.asarray(w)
            if not np.array_equal(a.view(f"u{a.itemsize}"), w.view(f"u{w.itemsize}")):
                raise RuntimeError(f"host AdamW kernel ({'bf16' if bf16 else 'fp32'}) disagrees with the contract's "
                                   f"reference on {name}; not timing a wrong kernel")

    def __call__(self):
        self.team.run(_adamw_range, self.ranges, *self.args, self.s)


class TorchCase:
    """``torch.optim.AdamW(fused=True | foreach=True)`` on one fp32 CPU parameter of ``numel``
    elements (state allocated by two untimed steps). Calling it runs ``step()``."""

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


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def environment(torch=None) -> dict:
    """What may move the ratios between machines and runs."""
    env = {"python": sys.version.split()[0], "numpy": np.__version__, "cpus": os.cpu_count(), "cpu": cpu_name(),
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


def make_case(name: str, team: Team, numel: int, torch):
    if name.startswith("torch_"):
        return TorchCase(torch, numel, name[6:])
    return {"ceiling": lambda: CeilingCase(team, numel), "ceiling_plain": lambda: CeilingCase(team, numel, False),
            "ours": lambda: AdamWCase(team, numel), "ours_bf16": lambda: AdamWCase(team, numel, bf16=True)}[name]()


def summarize(names, times, numel) -> dict:
    """Per contender: best/median ms, GB/s, ratios to torch_fused and to the ceiling (by
    time: all move 28 B/element), per-round medians."""
    out = {}
    med = {n: statistics.median(t for r in times[n] for t in r) for n in names}
    best = {n: min(t for r in times[n] for t in r) for n in names}
    for n in names:
        r = {"ms_best": 1e3 * best[n], "ms_median": 1e3 * med[n], "gbps_median": numel * BYTES_PER_ELEMENT / med[n] / 1e9,
             "bytes_per_element": BYTES_PER_ELEMENT, "round_medians_ms": [1e3 * statistics.median(r) for r in times[n]]}
        if "torch_fused" in names:
            r["x_torch_median"] = med["torch_fused"] / med[n]
            r["x_torch_best"] = best["torch_fused"] / best[n]
            r["x_torch_per_round"] = [statistics.median(a) / statistics.median(b)
                                      for a, b in zip(times["torch_fused"], times[n])]
        if "ceiling" in names:
            r["of_ceiling_median"] = med["ceiling"] / med[n]
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
    if not args.no_torch and any(n.startswith("torch_") for n in names):
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            print("torch not installed: torch contenders left out", file=sys.stderr)
    names = [n for n in names if torch is not None or not n.startswith("torch_")]
    env, n = environment(torch), args.numel
    print(f"# {env}\n# numel={n}, threads={args.threads}, {args.rounds} rounds x {args.repeats} passes, "
          f"gap {args.gap} s", flush=True)
    times = {name: [] for name in names}
    with Team(args.threads) as team:
        cases = {name: make_case(name, team, n, torch) for name in names}
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
                f"{k} {n * BYTES_PER_ELEMENT / statistics.median(times[k][-1]) / 1e9:6.1f}" for k in names), flush=True)
        del cases
    res = summarize(names, times, n)
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
