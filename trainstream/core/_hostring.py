"""The host placement's staging ring for updates of buffers in GPU memory that the caller owns (the JAX adapter's
``mode="cpu"`` on a GPU): each update's gradients (and weights without a master) go down piece by piece through a
few pinned buffers, the host workers update the state (host memory, in place) from them, and each piece's result
(its new weights, or optax's ``u``) goes back up from the same buffer into the caller's. Its pinned memory is
:func:`host_ring_bytes`: at most :data:`HOST_RING_DEPTH` buffers of :data:`HOST_RING_ELEMS` elements, whatever the
model's size (staging as large as the model, three times for float32 leaves, took 12 bytes per parameter: 80.6 GB at
7B).

Ordering, on two streams of the ring's own (the pieces' copies down, and up: both PCIe directions at once): both
wait for the caller's stream at the update's start; a buffer is copied into only after its last copy up (an event of
the up stream) and once the worker that updated it has queued that copy (a semaphore per buffer); the workers wait
for each piece's copies down (an event); the caller's stream waits for both streams at the end. A piece that fails
leaves its buffer free (its result is not copied up; the update raises). Imports neither torch nor jax.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from .. import _cuda
from .. import contract as C
from ._budget import _ITEMSIZE
from ._external import ExternalUpdate

__all__ = ["HOST_RING_DEPTH", "HOST_RING_ELEMS", "HostRing", "StagedLeaf", "host_ring_bytes", "ring_geometry"]

#: Elements per piece (a buffer holds a piece's gradient, float32 weights and float32 update: 48 MiB).
HOST_RING_ELEMS = 1 << 22
#: Buffers of the ring: pieces in flight (copied down, updated by the workers, copied up), 32M elements at most.
HOST_RING_DEPTH = 8
_SLOT_BYTES = 12  # per element, 4 bytes each at most: the gradient, the weights, the update u
_ALIGN = 1024  # elements: pieces and the arrays in a buffer start 4 KiB aligned


def ring_geometry(numels: Sequence[int]) -> tuple[int, int]:
    """``(elements per buffer, buffers)`` of the ring that an update of leaves of ``numels`` elements needs: pieces
    of up to :data:`HOST_RING_ELEMS` (less for a model whose largest leaf is smaller), as many buffers as pieces, at
    most :data:`HOST_RING_DEPTH`."""
    largest = max((int(n) for n in numels), default=0)
    if largest <= 0:
        return 0, 0
    elems = min(HOST_RING_ELEMS, -(-largest // _ALIGN) * _ALIGN)
    pieces = sum(-(-int(n) // elems) for n in numels)
    return elems, min(HOST_RING_DEPTH, pieces)


def host_ring_bytes(numels: Sequence[int]) -> int:
    """Pinned bytes of the ring (one per device) for an update of leaves of ``numels`` elements: its buffers and the
    update's scalars (:data:`trainstream.contract.N_SCALARS` float32 per leaf)."""
    elems, count = ring_geometry(numels)
    return count * _SLOT_BYTES * elems + (4 * C.N_SCALARS * len(numels) if count else 0)


class StagedLeaf(NamedTuple):
    """One leaf of a :meth:`HostRing.update`: its buffers in GPU memory (device addresses) and its state in host
    memory (flat NumPy views, updated in place)."""

    grad: int  # the gradient (gdtype) in GPU memory
    gdtype: str  # of the gradient and the weights
    weights: int  # the weights (gdtype: float32, or fp16/bf16 with optax's own state) in GPU memory, copied down and
    #               read; 0: fp16/bf16 weights with a master
    master: np.ndarray | None  # the float32 master of fp16/bf16 weights (host memory); None with ``weights``
    m: np.ndarray  # the moments (host memory): float32, or the uint16 bits of optax's 16-bit state
    v: np.ndarray
    out: int  # GPU memory that receives the result: the new weights (gdtype), or with ``emit_u`` optax's u (the
    #           leaf's dtype where m and v are 16-bit, else float32)
    emit_u: bool  # with ``weights``: u (the weights read only); else the new weights
    numel: int


class HostRing:
    """The ring of CUDA device ``device`` (:mod:`~trainstream.core._hostring`): two streams, and pinned buffers that
    grow to what the updates ask (:func:`ring_geometry`), kept for the next. One update at a time (a lock)."""

    def __init__(self, device: int):
        self.ctx = _cuda.context(device)
        self.lock = threading.Lock()
        self.bufs: list = []  # _cuda.Mapped, ``elems`` elements of _SLOT_BYTES each
        self.elems = 0
        self.scalars = None  # _cuda.Mapped: N_SCALARS float32 per leaf
        self.rows = 0
        self.d2h = self.h2d = None
        try:
            self.d2h = self.ctx.create_stream()
            self.h2d = self.ctx.create_stream()
        except BaseException:
            self.close()
            raise
        self.freed: list = []  # per buffer: an event after its last copy up (None: never used)
        self.free: list[threading.Semaphore] = []  # per buffer: no piece holds it (its copy up is queued)
        self.next = 0

    @property
    def nbytes(self) -> int:
        """Pinned bytes held (:func:`host_ring_bytes` of the largest update so far)."""
        return len(self.bufs) * _SLOT_BYTES * self.elems + 4 * C.N_SCALARS * self.rows

    def _reserve(self, numels: Sequence[int]) -> None:
        """Grow the buffers to :func:`ring_geometry` of ``numels`` and the scalars to one row per leaf (larger
        buffers replace all the old ones, once the streams are idle)."""
        elems, count = ring_geometry(numels)
        if elems > self.elems or len(numels) > self.rows:
            for st in (self.d2h, self.h2d):  # the previous update's copies up may still run
                self.ctx.stream_synchronize(st)
        if elems > self.elems:
            old, self.bufs, self.freed, self.free, self.elems, self.next = self.bufs, [], [], [], elems, 0
            for b in old:
                b.free()
        while len(self.bufs) < count:
            self.bufs.append(self._alloc(_SLOT_BYTES * self.elems))
            self.freed.append(None)
            self.free.append(threading.Semaphore(1))
        if len(numels) > self.rows:
            old, self.scalars, self.rows = self.scalars, None, 0
            if old is not None:
                old.free()
            self.scalars = self._alloc(4 * C.N_SCALARS * len(numels))
            self.rows = len(numels)

    def _alloc(self, nbytes: int):
        try:
            return self.ctx.alloc_mapped(nbytes)
        except MemoryError as exc:
            raise MemoryError(f"TrainStream: the host staging ring ({self.nbytes:,} pinned bytes so far) could not "
                              f"grow by {nbytes:,} bytes: {exc}") from exc

    def update(self, engine: Any, leaves: Sequence[StagedLeaf], scalars: int, stream: int) -> None:
        """The update of ``leaves`` on ``engine``'s host workers (``Engine.update_external``, optax/cuda's
        arithmetic), their scalars (``N_SCALARS`` float32 per leaf) at device address ``scalars``, after the work
        queued on ``stream`` so far; ``stream`` then waits for the copies up. Blocks until the host work is done;
        raises its first failure."""
        if not any(lf.numel for lf in leaves):
            return
        with self.lock:
            ctx = self.ctx
            self._reserve([lf.numel for lf in leaves])
            start = _cuda.Event(ctx, stream)  # the gradients and weights are written, ``out`` is free
            ctx.stream_wait_event(self.d2h, start)
            ctx.stream_wait_event(self.h2d, start)
            ctx.memcpy_dtoh_async(self.scalars.host_ptr, scalars, 4 * C.N_SCALARS * len(leaves), self.d2h)
            rows = _view(self.scalars.host_ptr, C.N_SCALARS * len(leaves), np.float32).reshape(-1, C.N_SCALARS)
            held: dict[int, int] = {}  # piece -> its buffer, until released
            release = lambda k: self.free[held.pop(k)].release()  # noqa: E731 (from the worker that ends piece k)
            try:
                engine.update_external(self._pieces(leaves, rows, held), "cuda", release)
            finally:
                for b in held.values():  # pieces made but never queued (a failure)
                    self.free[b].release()
                ctx.stream_wait_event(stream, _cuda.Event(ctx, self.d2h))
                ctx.stream_wait_event(stream, _cuda.Event(ctx, self.h2d))

    def _pieces(self, leaves: Sequence[StagedLeaf], rows: np.ndarray, held: dict) -> Iterator[ExternalUpdate]:
        """The pieces of ``leaves``, each made once a buffer is free: its copies down queued, the item that updates
        it and queues its copy up."""
        ctx, elems, k = self.ctx, self.elems, 0
        for i, lf in enumerate(leaves):
            item = _ITEMSIZE[lf.gdtype]
            gview = np.float32 if lf.gdtype == "float32" else np.uint16
            for lo in range(0, lf.numel, elems):
                n = min(elems, lf.numel - lo)
                b, self.next = self.next, (self.next + 1) % len(self.bufs)
                self.free[b].acquire()
                held[k] = b
                base = self.bufs[b].host_ptr
                if self.freed[b] is not None:
                    ctx.stream_wait_event(self.d2h, self.freed[b])  # its last copy up has read it
                ctx.memcpy_dtoh_async(base, lf.grad + item * lo, item * n, self.d2h)
                g = _view(base, n, gview)
                if lf.weights:
                    w_at = base + 4 * elems
                    ctx.memcpy_dtoh_async(w_at, lf.weights + item * lo, item * n, self.d2h)
                    p = _view(w_at, n, gview)
                    if lf.emit_u:  # u in a third array, the weights only read
                        u16 = item == 2 and lf.m.itemsize == 2  # optax's u: fp16/bf16 state's dtype, else float32
                        ui = 2 if u16 else 4
                        out, out_kind, up = _view(base + 8 * elems, n, np.uint16 if u16 else np.float32), "u", \
                            base + 8 * elems
                    else:  # the weights in place
                        out, out_kind, up, ui = None, None, w_at, item
                    up_bytes, dst = ui * n, lf.out + ui * lo
                else:  # the master in host memory; the rounded weights overwrite the gradient, element by element
                    p, out, out_kind, up, up_bytes, dst = lf.master[lo:lo + n], g, lf.gdtype, base, item * n, \
                        lf.out + item * lo
                landed = _cuda.Event(ctx, self.d2h)
                yield ExternalUpdate(p, lf.m[lo:lo + n], lf.v[lo:lo + n], g, lf.gdtype, out, out_kind, rows[i], landed,
                                     functools.partial(self._up, b, dst, up, up_bytes))
                k += 1

    def _up(self, b: int, dst: int, src: int, nbytes: int) -> None:
        """A piece's copy up from buffer ``b`` (a worker calls it once the piece is updated)."""
        self.ctx.memcpy_htod_async(dst, src, nbytes, self.h2d)
        self.freed[b] = _cuda.Event(self.ctx, self.h2d)

    def close(self) -> None:
        """Wait for the copies, free the buffers and the streams (also where the wait raises)."""
        streams = [st for st in (self.d2h, self.h2d) if st is not None]
        try:
            for st in streams:
                self.ctx.stream_synchronize(st)
        finally:
            bufs = self.bufs + ([self.scalars] if self.scalars is not None else [])
            self.bufs, self.scalars, self.elems, self.rows, self.d2h, self.h2d = [], None, 0, 0, None, None
            for b in bufs:
                b.free()
            for st in streams:
                self.ctx.destroy_stream(st)


def _view(ptr: int, count: int, dtype) -> np.ndarray:
    """A NumPy view (no copy) of ``count`` elements at host address ``ptr``."""
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype, count)
