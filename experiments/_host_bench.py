"""Micro-benchmarks of the host kernels (no torch or jax import: a core module).

:func:`benchmark_host_adamw` times the fp32 ``torch``/``cpu`` AdamW update with the IEEE
sqrt (the vectorised specialisation; the same operation count as the ``torch``/``cuda``
variant that the engine runs for CUDA parameters; the MKL-sqrt specialisations that
reproduce torch for CPU parameters are scalar and slower) over ``numel``
elements split into ``threads`` contiguous ranges, each run by a thread of a persistent
pool (the kernels release the GIL). :func:`benchmark_rmw_bandwidth` times the in-place
read-modify-write stream ``a[i] += s*b[i]`` the same way: the memory bandwidth an
in-place update can reach on this machine (a plain copy would pay a hidden
write-allocate read, so it is not the right yardstick).

Bytes are counted as the fewest the operation must move: 28 per element for the update
(read ``p``, ``m``, ``v``, ``g``; write ``p``, ``m``, ``v``), 12 for the stream (read ``a``,
``b``; write ``a``).

For an interleaved comparison in one process (``bench_host_adamw.py``) the buffers must
outlive one measurement: :class:`AdamWCase` (the update, checked against the contract once)
and :class:`CeilingCase` (the machine's read-modify-write ceiling over the update's own
bytes: ``p``, ``m``, ``v`` read and written, ``g`` read, 28 B/element, a trivial body) keep
theirs; each call runs one full pass over all threads of a shared :class:`Team`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from trainstream import contract as C
from trainstream._jit import OPTS as _JIT_OPTS
from trainstream._host_kernels import KIND_BF16, KIND_F32, _AHEAD, _LINE, _STRIP, _prefetch_r, _prefetch_w, adamw_chunk

__all__ = ["AdamWCase", "CeilingCase", "Team", "benchmark_host_adamw", "benchmark_rmw_bandwidth", "split_ranges"]

ADAMW_BYTES_PER_ELEMENT = 28
RMW_BYTES_PER_ELEMENT = 12
_ALIGN = 16  # range boundaries on 64-byte lines of float32


def split_ranges(numel: int, parts: int, align: int = _ALIGN) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, numel)``, boundaries multiples of ``align``."""
    bounds = [min(numel, (numel * k // parts) // align * align) for k in range(parts + 1)]
    bounds[-1] = numel
    return [(b, e) for b, e in zip(bounds[:-1], bounds[1:])]


class Team:
    """``threads`` workers: ``threads - 1`` pool threads plus the calling thread."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, "ts-bench") if threads > 1 else None

    def run(self, fn, ranges, *args):
        """``fn(*args, begin, end)`` for each range, in parallel; returns when all are done."""
        futures = [self._pool.submit(fn, *args, b, e) for b, e in ranges[1:]] if self._pool else []
        b, e = ranges[0]
        fn(*args, b, e)
        for f in futures:
            f.result()

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_args(numel, threads, repeats):
    for name, x in (("numel", numel), ("threads", threads), ("repeats", repeats)):
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")


def _init_adamw_state(p, m, v, g, b, e):
    """Deterministic, normal-range values (first touch by the thread that will use them)."""
    x = np.arange(b, e, dtype=np.float64) * 0.618
    p[b:e] = np.sin(x)
    m[b:e] = 0.1 * np.sin(x + 1.0)
    v[b:e] = 0.01 * np.abs(np.sin(x + 2.0))
    g[b:e] = np.sin(x + 3.0)


def _init_rmw(a, b_, lo, hi):
    x = np.arange(lo, hi, dtype=np.float64) * 0.618
    a[lo:hi] = np.sin(x)
    b_[lo:hi] = np.cos(x)


def _time_best(team, fn, ranges, args, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        team.run(fn, ranges, *args)
        best = min(best, time.perf_counter() - t0)
    return best


def _adamw_range(p, m, v, g, s, mode, begin, end):
    adamw_chunk(C.VARIANT_TORCH_CPU, p, m, v, g, 0, None, 0, begin, end, s, mode)


def benchmark_host_adamw(numel: int, threads: int = 1, repeats: int = 5, seed: int = 0,
                         sqrt_mode: int = 0) -> dict:
    """Time the fp32 host AdamW update (``torch``/``cpu`` convention) of ``numel`` elements.

    ``sqrt_mode``: the square root of that convention (:mod:`trainstream._cpu_sqrt`):
    0, IEEE (the root of torch's fused CPU AdamW and of every CUDA convention), or the MKL
    path that torch's default CPU AdamW takes on this machine
    (``trainstream.backends.torch.torch_cpu_code()``).

    The array is split into ``threads`` contiguous ranges, one per thread. Before timing,
    one full threaded update is checked against :func:`~trainstream.contract.reference_update`
    on a sample of elements (every range boundary included); a mismatch raises
    ``RuntimeError``. Returns the best of ``repeats`` timed updates:
    ``{"ms", "gelems_per_s", "gbps", "threads", "numel"}`` (28 bytes per element).
    """
    _check_args(numel, threads, repeats)
    numel, threads = int(numel), int(threads)
    hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
    ranges = split_ranges(numel, threads)
    p, m, v, g = (np.empty(numel, np.float32) for _ in range(4))
    with Team(threads) as team:
        team.run(_init_adamw_state, ranges, p, m, v, g)

        # correctness on a sample, before any timing
        rng = np.random.default_rng(seed)
        edges = np.array([x for b, e in ranges for x in (b, e - 1)], np.int64)
        idx = np.unique(np.concatenate([edges, rng.integers(0, numel, min(numel, 65536))]))
        s = C.step_scalars(hp, 10, "torch", "cpu", clip=0.75)
        from trainstream._cpu_sqrt import sqrt_array  # noqa: PLC0415

        want = C.reference_update(p[idx], m[idx], v[idx], g[idx], s, "torch", "cpu",
                                  sqrt=lambda x: sqrt_array(x, sqrt_mode))
        team.run(_adamw_range, ranges, p, m, v, g, s, sqrt_mode)
        for name, got, w in zip("pmv", (p[idx], m[idx], v[idx]), want):
            if not np.array_equal(got.view(np.uint32), w.view(np.uint32)):
                bad = int(np.count_nonzero(got.view(np.uint32) != w.view(np.uint32)))
                raise RuntimeError(
                    f"host AdamW kernel disagrees with the contract's reference on {bad} of "
                    f"{idx.size} sampled elements of {name}; not timing a wrong kernel"
                )
        s = C.step_scalars(hp, 11, "torch", "cpu", clip=0.75)
        dt = _time_best(team, _adamw_range, ranges, (p, m, v, g, s, sqrt_mode), repeats)
    return {
        "ms": dt * 1e3,
        "gelems_per_s": numel / dt / 1e9,
        "gbps": numel * ADAMW_BYTES_PER_ELEMENT / dt / 1e9,
        "threads": threads,
        "numel": numel,
    }


@njit(**dict(_JIT_OPTS, cache=False, boundscheck=False))  # loaded from its file: no disk cache
def rmw_chunk(a, b, s, begin, end):
    """``a[i] += s*b[i]`` over ``[begin, end)`` (float32, two roundings, no FMA)."""
    for i in range(np.uint64(begin), np.uint64(end)):
        a[i] = a[i] + s * b[i]


@njit(**dict(_JIT_OPTS, cache=False, boundscheck=False))  # loaded from its file: no disk cache
def rmw_chunk_prefetch(a, b, s, begin, end):
    """:func:`rmw_chunk` with the AdamW kernel's strips and software prefetch."""
    stop = np.uint64(end)
    lo = np.uint64(begin)
    while lo < stop:
        hi = min(lo + _STRIP, stop)
        for q in range(np.uint64(0), _STRIP, _LINE):
            _prefetch_w(a, lo + _AHEAD + q)
            _prefetch_r(b, lo + _AHEAD + q)
        for i in range(lo, hi):
            a[i] = a[i] + s * b[i]
        lo = hi


def benchmark_rmw_bandwidth(numel: int, threads: int = 1, repeats: int = 5, prefetch: bool = True) -> float:
    """Memory bandwidth, in GB/s, of the in-place stream ``a[i] += s*b[i]`` (12 B/element).

    Same threading as :func:`benchmark_host_adamw`; best of ``repeats`` passes. The
    result is checked on a sample before timing. ``prefetch`` (default) runs the loop
    with the same strips and software prefetch as the AdamW kernel, so that the
    yardstick is as strong as the kernel it measures (on the 16-core Xeon host the
    prefetching AdamW kernel outran the plain stream); ``prefetch=False`` is the plain loop.
    """
    kernel = rmw_chunk_prefetch if prefetch else rmw_chunk
    _check_args(numel, threads, repeats)
    numel, threads = int(numel), int(threads)
    ranges = split_ranges(numel, threads)
    a = np.empty(numel, np.float32)
    b = np.empty(numel, np.float32)
    s = np.float32(1e-3)
    with Team(threads) as team:
        team.run(_init_rmw, ranges, a, b)
        idx = np.unique(np.concatenate([[0, numel - 1], np.random.default_rng(0).integers(0, numel, 4096)]))
        want = a[idx] + s * b[idx]
        team.run(kernel, ranges, a, b, s)
        if not np.array_equal(a[idx], want):
            raise RuntimeError("read-modify-write kernel gave wrong values; not timing it")
        dt = _time_best(team, kernel, ranges, (a, b, s), repeats)
    return numel * RMW_BYTES_PER_ELEMENT / dt / 1e9


# -- persistent cases for interleaved measurements (bench_host_adamw.py) ----------------------


@njit(**dict(_JIT_OPTS, cache=False, boundscheck=False))  # loaded from its file: no disk cache
def ceiling_chunk(p, m, v, g, s, begin, end):
    """The AdamW update's memory traffic with a trivial body: ``g`` read; ``p``, ``m``, ``v``
    read and written (28 B/element), with the AdamW kernel's strips and software prefetch."""
    stop = np.uint64(end)
    lo = np.uint64(begin)
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


@njit(**dict(_JIT_OPTS, cache=False, boundscheck=False))  # loaded from its file: no disk cache
def ceiling_chunk_plain(p, m, v, g, s, begin, end):
    """:func:`ceiling_chunk` as one plain loop (no strips, no software prefetch)."""
    for i in range(np.uint64(begin), np.uint64(end)):
        gi = s * g[i]
        p[i] = p[i] + gi
        m[i] = m[i] + gi
        v[i] = v[i] + gi


class CeilingCase:
    """The read-modify-write ceiling over the AdamW update's bytes (28 B/element): ``numel``
    elements of ``p``, ``m``, ``v``, ``g`` (float32), first touched by the threads that
    use them; checked on a sample once. Calling it runs one pass on ``team``."""

    bytes_per_element = ADAMW_BYTES_PER_ELEMENT

    def __init__(self, team: Team, numel: int, prefetch: bool = True):
        _check_args(numel, team.threads, 1)
        self.team, self.numel = team, int(numel)
        self.ranges = split_ranges(self.numel, team.threads)
        self.kernel = ceiling_chunk if prefetch else ceiling_chunk_plain
        self.bufs = tuple(np.empty(self.numel, np.float32) for _ in range(4))  # p, m, v, g
        team.run(_init_adamw_state, self.ranges, *self.bufs)
        self.s = np.float32(1e-3)
        p, m, v, g = self.bufs
        idx = np.unique(np.concatenate([[0, self.numel - 1], np.random.default_rng(0).integers(0, self.numel, 4096)]))
        want = [a[idx] + self.s * g[idx] for a in (p, m, v)]
        self()
        if not all(np.array_equal(a[idx], w) for a, w in zip((p, m, v), want)):
            raise RuntimeError("ceiling kernel gave wrong values; not timing it")

    def __call__(self):
        self.team.run(self.kernel, self.ranges, *self.bufs, self.s)


def _adamw_range_any(p, m, v, g, out, okind, variant, gkind, s, mode, begin, end):
    adamw_chunk(variant, p, m, v, g, gkind, out, okind, begin, end, s, mode)


class AdamWCase:
    """One host AdamW configuration with persistent buffers: ``variant`` (contract id),
    ``gkind`` :data:`KIND_F32` (fp32 gradient, fp32 weights only: 28 B/element) or
    :data:`KIND_BF16` (bf16 gradient bits; the rounded bf16 weights written back into the
    gradient buffer, as the engine does for bf16 CUDA parameters: 12 + 2 read, 12 + 2
    written, also 28 B/element), ``sqrt_mode`` the torch/cpu root mode (0: IEEE).

    The first update is checked bit for bit against
    :func:`~trainstream.contract.reference_update` on a sample (range boundaries included);
    a mismatch raises ``RuntimeError``. Calling the case runs one full update on ``team``
    with the scalars of step 11, unclipped, every call (the arithmetic does not depend on
    them; the bf16 case then reads its own weights as the gradient, values of the same range).
    """

    bytes_per_element = ADAMW_BYTES_PER_ELEMENT

    def __init__(self, team: Team, numel: int, variant: int = C.VARIANT_TORCH_CPU, gkind: int = KIND_F32,
                 sqrt_mode: int = 0, seed: int = 0):
        _check_args(numel, team.threads, 1)
        if gkind not in (KIND_F32, KIND_BF16):
            raise ValueError(f"gkind must be KIND_F32 or KIND_BF16, got {gkind}")
        self.team, self.numel, self.variant, self.gkind, self.mode = team, int(numel), variant, gkind, sqrt_mode
        self.ranges = split_ranges(self.numel, team.threads)
        p, m, v, g32 = (np.empty(self.numel, np.float32) for _ in range(4))
        team.run(_init_adamw_state, self.ranges, p, m, v, g32)
        if gkind == KIND_BF16:
            g = np.empty(self.numel, np.uint16)
            team.run(_to_bf16_range, self.ranges, g32, g)
            del g32
            out, okind = g, KIND_BF16  # the weights into the gradient buffer (OUT_IN_GRAD)
        else:
            g, out, okind = g32, None, KIND_F32
        self.p, self.m, self.v, self.g, self.out, self.okind = p, m, v, g, out, okind
        hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
        convention, platform = _CONVENTION[variant]
        rng = np.random.default_rng(seed)
        edges = np.array([x for b, e in self.ranges for x in (b, e - 1)], np.int64)
        idx = np.unique(np.concatenate([edges, rng.integers(0, self.numel, min(self.numel, 65536))]))
        clip = 0.75 if gkind == KIND_F32 else 1.0  # bf16: as training runs without clipping
        s = C.step_scalars(hp, 10, convention, platform, clip=clip)
        self.s = C.step_scalars(hp, 11, convention, platform, clip=1.0)
        from trainstream._cpu_sqrt import sqrt_array  # noqa: PLC0415

        gs = g[idx] if gkind == KIND_F32 else C.bf16_bits_to_f32(g[idx])
        want = C.reference_update(p[idx], m[idx], v[idx], gs, s, convention, platform,
                                  sqrt=lambda x: sqrt_array(x, sqrt_mode),
                                  grad_dtype="float32" if gkind == KIND_F32 else "bfloat16")
        self._run(s)
        got = [p[idx], m[idx], v[idx]]
        names = ["p", "m", "v"]
        if gkind == KIND_BF16:
            want = [*want, C.f32_to_bf16_bits(want[0])]
            got.append(g[idx])
            names.append("bf16 weights")
        for name, a, w in zip(names, got, want):
            a, w = np.asarray(a), np.asarray(w)
            if not np.array_equal(a.view(np.uint32 if a.dtype == np.float32 else np.uint16),
                                  w.view(np.uint32 if w.dtype == np.float32 else np.uint16)):
                raise RuntimeError(f"host AdamW kernel (variant {variant}, gkind {gkind}) disagrees with the "
                                   f"contract's reference on {name}; not timing a wrong kernel")

    def _run(self, s):
        self.team.run(_adamw_range_any, self.ranges, self.p, self.m, self.v, self.g, self.out, self.okind,
                      self.variant, self.gkind, s, self.mode)

    def __call__(self):
        self._run(self.s)


_CONVENTION = {C.VARIANT_TORCH_CPU: ("torch", "cpu"), C.VARIANT_TORCH_CUDA: ("torch", "cuda")}


def _to_bf16_range(src, dst, b, e):
    dst[b:e] = C.f32_to_bf16_bits(src[b:e])
