"""The staging ring of the device placement: AdamW updates of state in pinned host memory, copied through a few
buffers of GPU memory (0.99 of the bidirectional PCIe rate against zero-copy's 0.83; H200, experiments/RESULTS.md),
for the slots of :class:`~trainstream.core._device.DevicePlacement` and the buffers of its ``launch_external``.
Imports neither torch nor jax.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Sequence

from .. import _cuda

__all__ = ["RING_DEPTH", "RING_ELEMS", "StagingRing", "staging_ring"]

#: :class:`StagingRing`: each buffer holds ``12 * RING_ELEMS`` bytes (24 MiB: 2M elements of three fp32 arrays,
#: 6M of two bf16 ones), and buffers: 72 MiB of GPU memory, 0.986 (fp32) / 0.987 (bf16) of the bidirectional
#: memcpy rate (H200, experiments/RESULTS.md).
RING_ELEMS = 1 << 21
RING_DEPTH = 3
_ALIGN = 16  # elements: a piece that splits a tensor ends at a multiple of 16 (the next piece's vector path)
_ARRAY_ALIGN = 64  # bytes: every staged array starts 64-byte aligned


class StagingRing:
    """Staged AdamW updates of pinned host-memory state, for both adapters. Per ring buffer the state arrays of a
    few tensors, or of a piece of one (each array 64-byte aligned; any element sizes: fp32, 16-bit state, an fp32
    master, max_exp_avg_sq), are copied in on the H2D stream after the buffer's last copy back and the entry's
    ``wait`` event, updated by the kernel on the caller's stream (the same bits as zero-copy), and copied back on
    the D2H stream."""

    def __init__(self, device: int, dk):
        self.ctx, self.dk = _cuda.context(device), dk
        self.mem: list = []
        self.h2d = self.d2h = None
        try:
            self.arena = 3 * 4 * RING_ELEMS  # bytes per buffer
            self.mem = [dk.alloc_device(self.arena, device) for _ in range(RING_DEPTH)]
            self.h2d = self.ctx.create_stream()
            self.d2h = self.ctx.create_stream()  # a failure here: close() destroys h2d
        except BaseException:
            self.close()
            raise
        self.freed: list = [None] * RING_DEPTH  # each buffer's last copy back
        self.next = 0
        self.last = None  # the last copy back queued (the D2H stream is in order: all before it too)
        self.nbytes = sum(m.nbytes for m in self.mem)
        self.lock = threading.Lock()

    def run(self, launch: Callable[[list], Any], entries: Sequence, stream: int, after: Any = None) -> list:
        """Queue the updates of ``entries``, each ``(arrays, n, item, wait)``: its state arrays in pinned host memory,
        each a host address (fp32) or ``(host address, bytes per element)``, its element count, ``item(lo, n,
        dev_ptrs)`` -> the kernel item of elements ``lo:lo+n`` at the staged arrays' device addresses, and an event
        (or None) to copy in after. ``launch(items)`` queues the updates of up to ``MULTI_MAX`` items on ``stream``,
        after ``after``. Returns per entry the event of its last copy back (None for an empty one)."""
        done: list = [None] * len(entries)
        with self.lock:
            if after is not None:
                self.ctx.stream_wait_event(self.h2d, after)
            pieces: list = []
            pos = 0
            for e, (arrays, total, _, _) in enumerate(entries):
                sizes = [a[1] if isinstance(a, tuple) else 4 for a in arrays]
                lo = 0
                while lo < total:
                    n = self._fit(sizes, pos, total - lo)
                    if n == 0:  # this buffer is full
                        self._dispatch(launch, entries, pieces, stream, done)
                        pieces, pos = [], 0
                        continue
                    pieces.append((e, lo, n, pos))
                    pos += self._span(sizes, n)
                    lo += n
                    if len(pieces) == self.dk.MULTI_MAX:
                        self._dispatch(launch, entries, pieces, stream, done)
                        pieces, pos = [], 0
            if pieces:
                self._dispatch(launch, entries, pieces, stream, done)
        return done

    @staticmethod
    def _span(sizes, n: int) -> int:
        """Bytes that arrays of ``sizes`` bytes per element take for ``n`` elements, each 64-byte aligned."""
        return sum(-(-n * sz // _ARRAY_ALIGN) * _ARRAY_ALIGN for sz in sizes)

    def _fit(self, sizes, pos: int, remaining: int) -> int:
        """Elements of the next piece at byte ``pos`` of a buffer: all ``remaining`` if they fit, else the most
        that fit, a multiple of ``_ALIGN`` (0: none; never 0 in an empty buffer)."""
        free = self.arena - pos
        if self._span(sizes, remaining) <= free:
            return remaining
        n = max(0, free - _ARRAY_ALIGN * len(sizes)) // sum(sizes) // _ALIGN * _ALIGN
        if n == 0 and pos == 0:
            raise ValueError(f"staging ring: a buffer of {self.arena} bytes cannot hold {_ALIGN} elements of "
                             f"arrays of {sizes} bytes per element")
        return n

    def _dispatch(self, launch, entries, pieces, stream, done) -> None:
        ctx, k = self.ctx, self.next
        self.next = (k + 1) % RING_DEPTH
        base = self.mem[k].dev_ptr
        if self.freed[k] is not None:
            ctx.stream_wait_event(self.h2d, self.freed[k])  # the buffer's last copy back
        copies, items = [], []
        for e, lo, n, pos in pieces:
            arrays, _, item, wait = entries[e]
            if lo == 0 and wait is not None and not wait.query():
                ctx.stream_wait_event(self.h2d, wait)  # the entry's previous update's state
            dev, at = [], base + pos
            for a in arrays:
                ptr, sz = a if isinstance(a, tuple) else (a, 4)
                dev.append(at)
                copies.append((at, ptr + sz * lo, sz * n))
                at += -(-n * sz // _ARRAY_ALIGN) * _ARRAY_ALIGN
            items.append(item(lo, n, dev))
        for d, h, nb in copies:
            ctx.memcpy_htod_async(d, h, nb, self.h2d)
        ctx.stream_wait_event(stream, _cuda.Event(ctx, self.h2d))
        launch(items)
        ctx.stream_wait_event(self.d2h, _cuda.Event(ctx, stream))
        for d, h, nb in copies:
            ctx.memcpy_dtoh_async(h, d, nb, self.d2h)
        self.last = self.freed[k] = _cuda.Event(ctx, self.d2h)
        for e, *_ in pieces:
            done[e] = self.last

    def close(self) -> None:
        """Wait for the copies, free the buffers and the streams (also where the wait raises)."""
        streams = [st for st in (self.h2d, self.d2h) if st is not None]
        try:
            for st in streams:
                self.ctx.stream_synchronize(st)
        finally:
            mem, self.mem, self.h2d, self.d2h = self.mem, [], None, None
            for m in mem:
                m.free()
            for st in streams:
                self.ctx.destroy_stream(st)


def staging_ring(device: int, dk, where: str) -> StagingRing | None:
    """A :class:`StagingRing`, or None with a warning when its 72 MiB of GPU memory are refused (zero-copy then)."""
    try:
        return StagingRing(device, dk)
    except MemoryError as exc:
        warnings.warn(f"TrainStream {where}: no GPU memory for the staging ring ({exc}); the update kernels "
                      "read the host-memory state over PCIe instead (same results, slower)", RuntimeWarning,
                      stacklevel=5)
        return None
