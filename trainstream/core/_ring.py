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

#: :class:`StagingRing`: fp32 elements per state array per buffer (8 MiB), and buffers: 72 MiB of GPU
#: memory, 0.986 (fp32) / 0.987 (bf16) of the bidirectional memcpy rate (H200, experiments/RESULTS.md).
RING_ELEMS = 1 << 21
RING_DEPTH = 3
_ALIGN = 16  # elements: every staged piece starts 64-byte aligned (the kernel's vector path)


class StagingRing:
    """Staged AdamW updates of pinned host-memory state, for both adapters. Per ring buffer the state of a few
    tensors, or a piece of one (64-byte aligned), is copied in on the H2D stream after the buffer's last copy back and
    the entry's ``wait`` event, updated by the kernel on the caller's stream (the same bits as zero-copy), and copied
    back on the D2H stream."""

    def __init__(self, device: int, dk):
        self.ctx, self.dk = _cuda.context(device), dk
        self.mem: list = []
        self.h2d = self.d2h = None
        try:
            self.mem = [dk.alloc_device(3 * 4 * RING_ELEMS, device) for _ in range(RING_DEPTH)]
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
        """Queue the updates of ``entries``, each ``(host_ptrs, n, item, wait)``: the host addresses of its fp32 state
        arrays (m, v[, master]), its element count, ``item(lo, n, dev_ptrs)`` -> the kernel item of elements
        ``lo:lo+n`` at the staged arrays' device addresses, and an event (or None) to copy in after. ``launch(items)``
        queues one launch (at most ``MULTI_MAX`` items) on ``stream``, after ``after``. Returns per entry the event of
        its last copy back (None for an empty one)."""
        done: list = [None] * len(entries)
        with self.lock:
            if after is not None:
                self.ctx.stream_wait_event(self.h2d, after)
            pieces: list = []
            pos = 0
            for e, (_, total, _, _) in enumerate(entries):
                lo = 0
                while lo < total:
                    n = min(total - lo, RING_ELEMS - pos)
                    pieces.append((e, lo, n, pos))
                    pos = -(-(pos + n) // _ALIGN) * _ALIGN
                    lo += n
                    if pos >= RING_ELEMS or len(pieces) == self.dk.MULTI_MAX:
                        self._dispatch(launch, entries, pieces, stream, done)
                        pieces, pos = [], 0
            if pieces:
                self._dispatch(launch, entries, pieces, stream, done)
        return done

    def _dispatch(self, launch, entries, pieces, stream, done) -> None:
        ctx, k = self.ctx, self.next
        self.next = (k + 1) % RING_DEPTH
        base = self.mem[k].dev_ptr
        if self.freed[k] is not None:
            ctx.stream_wait_event(self.h2d, self.freed[k])  # the buffer's last copy back
        copies, items = [], []
        for e, lo, n, pos in pieces:
            ptrs, _, item, wait = entries[e]
            if lo == 0 and wait is not None and not wait.query():
                ctx.stream_wait_event(self.h2d, wait)  # the entry's previous update's state
            dev = [base + 4 * (a * RING_ELEMS + pos) for a in range(3)]
            copies += [(dev[a], ptr + 4 * lo, 4 * n) for a, ptr in enumerate(ptrs)]
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
