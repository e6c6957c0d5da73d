"""The host kernel benchmark's cases (no torch or jax import): used by bench_host_adamw.py and
by tests/test_host_kernels.py (smoke).

Every case keeps its buffers for its life (allocated and first-touched by the threads that
use them) and runs one full pass over ``numel`` elements, split into one contiguous range
per thread of a shared :class:`Team` (the kernels release the GIL), when called:

* :class:`AdamWCase`: ``trainstream._host_kernels.adamw_chunk``, the function the engine's
  host placement calls, checked bit for bit against the contract's reference first;
* :class:`CeilingCase`: the host's read-modify-write ceiling over the update's own bytes
  (``p``, ``m``, ``v`` read and written, ``g`` read: 28 B/element; body ``x += s*g``), with
  the AdamW kernel's strips and software prefetch, or as one plain loop;
* :class:`RmwCase`: ``a += s*b`` (12 B/element), the older yardstick.

Bytes are the fewest the operation must move; :func:`benchmark_host_adamw` and
:func:`benchmark_rmw_bandwidth` time the best of ``repeats`` passes of a fresh case.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from trainstream import contract as C
from trainstream._cpu_sqrt import sqrt_array
from trainstream._host_kernels import KIND_BF16, KIND_F32, _AHEAD, _LINE, _STRIP, _prefetch_r, _prefetch_w, adamw_chunk
from trainstream._jit import OPTS as _JIT_OPTS

ADAMW_BYTES_PER_ELEMENT = 28
RMW_BYTES_PER_ELEMENT = 12
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
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, "ts-bench") if threads > 1 else None

    def run(self, fn, ranges, *args):
        """``fn(*args, begin, end)`` for each range, in parallel; returns when all are done."""
        futures = [self._pool.submit(fn, *args, b, e) for b, e in ranges[1:]] if self._pool else []
        fn(*args, *ranges[0])
        for f in futures:
            f.result()

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_args(**counts):
    for name, x in counts.items():
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")


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
def rmw_chunk(a, b, s, begin, end):
    """``a[i] += s*b[i]`` over ``[begin, end)`` (float32, two roundings, no FMA)."""
    for i in range(np.uint64(begin), np.uint64(end)):
        a[i] = a[i] + s * b[i]


@njit(**_NJIT)
def rmw_chunk_prefetch(a, b, s, begin, end):
    """:func:`rmw_chunk` with the AdamW kernel's strips and software prefetch."""
    stop, lo = np.uint64(end), np.uint64(begin)
    while lo < stop:
        hi = min(lo + _STRIP, stop)
        for q in range(np.uint64(0), _STRIP, _LINE):
            _prefetch_w(a, lo + _AHEAD + q)
            _prefetch_r(b, lo + _AHEAD + q)
        for i in range(lo, hi):
            a[i] = a[i] + s * b[i]
        lo = hi


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


class _StreamCase:
    """A trivial-body stream over float32 buffers (:class:`CeilingCase`, :class:`RmwCase`):
    ``bufs[:-1] += s * bufs[-1]``, checked on a sample once."""

    def __init__(self, team: Team, numel: int, kernel, n_bufs: int):
        _check_args(numel=numel, threads=team.threads)
        self.team, self.kernel, self.s = team, kernel, np.float32(1e-3)
        self.ranges = split_ranges(int(numel), team.threads)
        self.bufs = tuple(np.empty(int(numel), np.float32) for _ in range(n_bufs))
        team.run(_init, self.ranges, *self.bufs)
        idx = _sample(int(numel), self.ranges)
        want = [a[idx] + self.s * self.bufs[-1][idx] for a in self.bufs[:-1]]
        self()
        if not all(np.array_equal(a[idx], w) for a, w in zip(self.bufs, want)):
            raise RuntimeError(f"{type(self).__name__} kernel gave wrong values; not timing it")

    def __call__(self):
        self.team.run(self.kernel, self.ranges, *self.bufs, self.s)


class CeilingCase(_StreamCase):
    bytes_per_element = ADAMW_BYTES_PER_ELEMENT

    def __init__(self, team: Team, numel: int, prefetch: bool = True):
        super().__init__(team, numel, ceiling_chunk if prefetch else ceiling_chunk_plain, 4)


class RmwCase(_StreamCase):
    bytes_per_element = RMW_BYTES_PER_ELEMENT

    def __init__(self, team: Team, numel: int, prefetch: bool = True):
        super().__init__(team, numel, rmw_chunk_prefetch if prefetch else rmw_chunk, 2)


def _adamw_range(p, m, v, g, out, okind, variant, gkind, s, mode, begin, end):
    adamw_chunk(variant, p, m, v, g, gkind, out, okind, begin, end, s, mode)


def _to_bf16_range(src, dst, b, e):
    dst[b:e] = C.f32_to_bf16_bits(src[b:e])


class AdamWCase:
    """One host AdamW configuration: ``variant`` (contract id), ``gkind`` :data:`KIND_F32` (fp32
    gradient and weights) or :data:`KIND_BF16` (bf16 gradient bits; the rounded bf16 weights
    written back into the gradient buffer, as the engine does for bf16 CUDA parameters: also
    28 B/element), ``sqrt_mode`` the torch/cpu root (0: IEEE, the root of torch's fused CPU
    AdamW; ``trainstream.backends.torch.torch_cpu_code()``: its default AdamW's on this host).
    The first update is checked bit for bit on a sample; a mismatch raises ``RuntimeError``.
    Calling the case runs one update with the scalars of step 11, unclipped."""

    bytes_per_element = ADAMW_BYTES_PER_ELEMENT

    def __init__(self, team: Team, numel: int, variant: int = C.VARIANT_TORCH_CPU, gkind: int = KIND_F32,
                 sqrt_mode: int = 0):
        _check_args(numel=numel, threads=team.threads)
        if gkind not in (KIND_F32, KIND_BF16):
            raise ValueError(f"gkind must be KIND_F32 or KIND_BF16, got {gkind}")
        self.team, self.numel, self.variant, self.gkind, self.mode = team, int(numel), variant, gkind, sqrt_mode
        self.ranges = split_ranges(self.numel, team.threads)
        p, m, v, g = (np.empty(self.numel, np.float32) for _ in range(4))
        team.run(_init, self.ranges, p, m, v, g)
        out, okind = None, KIND_F32
        if gkind == KIND_BF16:
            g16 = np.empty(self.numel, np.uint16)
            team.run(_to_bf16_range, self.ranges, g, g16)
            g = out = g16  # the weights into the gradient buffer
            okind = KIND_BF16
        self.p, self.m, self.v, self.g, self.out, self.okind = p, m, v, g, out, okind
        conv = {C.VARIANT_TORCH_CPU: ("torch", "cpu"), C.VARIANT_TORCH_CUDA: ("torch", "cuda")}[variant]
        hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)
        s = C.step_scalars(hp, 10, *conv, clip=0.75 if gkind == KIND_F32 else 1.0)
        self.s = C.step_scalars(hp, 11, *conv, clip=1.0)
        idx = _sample(self.numel, self.ranges)
        gs = g[idx] if gkind == KIND_F32 else C.bf16_bits_to_f32(g[idx])
        want = list(C.reference_update(p[idx], m[idx], v[idx], gs, s, *conv, sqrt=lambda x: sqrt_array(x, sqrt_mode),
                                       grad_dtype="float32" if gkind == KIND_F32 else "bfloat16"))
        self._run(s)
        got = [p[idx], m[idx], v[idx]] + ([g[idx]] if gkind == KIND_BF16 else [])
        want += [C.f32_to_bf16_bits(want[0])] if gkind == KIND_BF16 else []
        for name, a, w in zip(("p", "m", "v", "bf16 weights"), got, want):
            a, w = np.asarray(a), np.asarray(w)
            if not np.array_equal(a.view(f"u{a.itemsize}"), w.view(f"u{w.itemsize}")):
                raise RuntimeError(f"host AdamW kernel (variant {variant}, gkind {gkind}) disagrees with the "
                                   f"contract's reference on {name}; not timing a wrong kernel")

    def _run(self, s):
        self.team.run(_adamw_range, self.ranges, self.p, self.m, self.v, self.g, self.out, self.okind,
                      self.variant, self.gkind, s, self.mode)

    def __call__(self):
        self._run(self.s)


def _best(case, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        case()
        best = min(best, time.perf_counter() - t0)
    return best


def benchmark_host_adamw(numel: int, threads: int = 1, repeats: int = 5, sqrt_mode: int = 0) -> dict:
    """The fp32 torch/cpu host update (:class:`AdamWCase`), best of ``repeats`` passes:
    ``{"ms", "gelems_per_s", "gbps", "threads", "numel"}`` (28 bytes per element)."""
    _check_args(numel=numel, threads=threads, repeats=repeats)
    with Team(int(threads)) as team:
        dt = _best(AdamWCase(team, numel, sqrt_mode=sqrt_mode), repeats)
    return {"ms": dt * 1e3, "gelems_per_s": numel / dt / 1e9, "gbps": numel * ADAMW_BYTES_PER_ELEMENT / dt / 1e9,
            "threads": int(threads), "numel": int(numel)}


def benchmark_rmw_bandwidth(numel: int, threads: int = 1, repeats: int = 5, prefetch: bool = True) -> float:
    """GB/s of the in-place stream ``a[i] += s*b[i]`` (:class:`RmwCase`), best of ``repeats``."""
    _check_args(numel=numel, threads=threads, repeats=repeats)
    with Team(int(threads)) as team:
        return numel * RMW_BYTES_PER_ELEMENT / _best(RmwCase(team, numel, prefetch), repeats) / 1e9
