"""Bounded staging for the host placement: *streamed* slots, whose update reads the gradient and the weights from
the device chunk by chunk through a ring of pinned buffers (:class:`StreamRing`) and uploads each chunk's new
weights from the same buffer, instead of staging buffers as large as the model. No torch or jax import.

Host bytes per element of a streamed slot: its moments (4 for fp16/bf16 state, 8 for float32) and an fp16/bf16
parameter's fp32 master (4) where it has one; the ring is a constant: one buffer of ``chunk`` elements of
:data:`~trainstream.core._budget.RING_ITEM` bytes per worker thread (a worker holds one while it updates a chunk).

A chunk's job (:meth:`Streaming.stream_update`): take a ring buffer; copy the chunk's gradient and weights into it
(D2H, after the compute stream's point at submission and after the buffer's last upload), wait for them; run the
kernel over the chunk (the moments and a master at their place, the gradient and the weights in the buffer); queue
the upload of the chunk's weights (H2D) and hand the buffer back with that upload's event (the next copy into it
waits for it on the device, not on the host). The slot's ``ready`` event is recorded after the last chunk's upload.

What such an update cannot do, and so what the adapter must not ask of it: be speculative (nothing of the gradient
is kept: it cannot be compared with ``param.grad`` later or redone from the copy), sum micro-batch gradients on the
host, or start before the gradient is final. The gradient tensor must keep its values until the slot's batch has
run (the adapter: until the next forward of the parameter, which waits for it; ``zero_grad`` waits).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .. import _host_kernels as K
from .. import contract as C
from ._budget import _ITEMSIZE, RING_ITEM, stream_ring_bytes

__all__ = ["EngineStreaming", "StreamRing", "Streaming"]

_KIND = {"float32": K.KIND_F32, "float16": K.KIND_F16, "bfloat16": K.KIND_BF16}


class StreamRing:
    """``count`` host buffers of ``chunk`` elements of :data:`RING_ITEM` bytes (``backend.host_empty``, pinned
    where the backend pins): a gradient chunk at byte 0, a weight chunk at byte ``4 * chunk``. :meth:`take` blocks
    while every buffer is held (never with ``count`` >= the workers: each holds at most one)."""

    def __init__(self, backend: Any, count: int, chunk: int):
        self.chunk = int(chunk)
        self.weights_at = 4 * self.chunk  # bytes
        self.buffers = [backend.host_empty(self.chunk * RING_ITEM // 4, "float32", pinned=True,
                                           what="grad.stream_ring") for _ in range(int(count))]
        self.nbytes = stream_ring_bytes(count, chunk)
        self.pinned = all(b.pinned for b in self.buffers)
        self._free = [(b, None) for b in self.buffers]  # (buffer, its last upload's event)
        self._cond = threading.Condition()

    def take(self) -> tuple[Any, Any]:
        """A free buffer and the event of its last upload (None: none, or done)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def give(self, buf: Any, upload: Any) -> None:
        """Hand ``buf`` back; ``upload``: the event of the last copy reading it."""
        with self._cond:
            self._free.append((buf, upload))
            self._cond.notify()

    def view(self, buf: Any, at: int, n: int, dtype: str) -> np.ndarray:
        """``n`` elements of ``dtype`` at byte ``at`` of ``buf`` (float32, or the uint16 bits of fp16/bf16)."""
        raw = buf.array.view(np.uint8)[at:at + n * _ITEMSIZE[dtype]]
        return raw.view(np.float32 if dtype == "float32" else np.uint16)


def _shift(tails: tuple, b: int, e: int) -> tuple:
    """The parts of ``tails`` (``[lo, hi)`` element ranges of the tensor) inside ``[b, e)``, relative to ``b``."""
    return tuple((max(lo, b) - b, min(hi, e) - b) for lo, hi in tails if lo < e and hi > b)


class Streaming:
    """The streamed-slot methods of :class:`~trainstream.core._host.HostPlacement` (its slots, pool, counters and
    ``_update_args``)."""

    _ring: StreamRing | None = None

    def _stream_ring(self) -> StreamRing:
        """The ring, allocated with the first streamed slot (one buffer per worker)."""
        if self._ring is None:
            for name in ("copy_range_to_host", "copy_range_to_device"):
                if not hasattr(self.backend, name):
                    raise NotImplementedError(f"TrainStream: this backend has no {name}; bounded staging (streamed "
                                              "slots) is not available with it")
            self._ring = StreamRing(self.backend, self.threads, self.chunk)
        return self._ring

    def _ring_bytes(self) -> tuple[int, int]:
        """The ring's ``(pinned, pageable)`` bytes (stats: in the host state bytes, as the plan's staging)."""
        ring = self._ring
        return (0, 0) if ring is None else (ring.nbytes, 0) if ring.pinned else (0, ring.nbytes)

    def _check_grad(self, sid: int, grad: Any = None, grad_dtype: str | None = None, staged: bool = False) -> None:
        """Refuse a gradient of another dtype than slot ``sid``'s, and for a streamed slot one to stage
        (``staged``: ``offload_grad``)."""
        s = self._slot(sid)
        if staged and s.streamed:
            raise ValueError(f"offload_grad: parameter slot {sid} is streamed (bounded staging): its update takes the "
                             "gradient from the device (stream_update, or step with the gradient)")
        if grad_dtype is not None and grad_dtype != s.dtype:
            raise TypeError(f"gradient of parameter slot {sid} has dtype {grad_dtype}, expected {s.dtype}")

    def streamed(self, sid: int) -> bool:
        """Whether slot ``sid`` is streamed (bounded staging)."""
        return self._slot(sid).streamed

    def stream_update(self, sid: int, hp: C.AdamWHyperParams, grad: Any, grad_dtype: str,
                      grad_div: float | None = None, eager: bool = False) -> None:
        """Queue the update of streamed slot ``sid`` from ``grad`` (its device gradient as it is now, final: the
        module docstring says what it must not be asked), its weights read from and written to the device chunk by
        chunk through the ring; ``grad_div``: as :meth:`step`'s; ``eager``: from a gradient hook (counted as
        ``eager_updates``)."""
        self._check_open()
        self.errors.check()
        s = self._slot(sid)
        if not s.streamed:
            raise ValueError(f"stream_update: parameter slot {sid} is not streamed (its gradient is staged: "
                             "offload_grad)")
        self._check_grad(sid, grad, grad_dtype)
        if grad_div is not None and (s.recipe is None or s.recipe.impl != "fused"):
            raise ValueError(f"stream_update: grad_div for parameter slot {sid}, whose recipe is not fused")
        ring, backend, param = self._stream_ring(), self.backend, s.param
        after = backend.record_compute(param)
        s.step += 1
        variant, scalars, extra = self._update_args(s, hp, np.float32(1.0), grad_div)
        recipe, vmax, tails = extra or (None, None, ())
        m, v, master, gkind, item = s.exp_avg.array, s.exp_avg_sq.array, s.master, _KIND[s.dtype], _ITEMSIZE[s.dtype]
        tc_code, wat = self.tc_code, ring.weights_at
        # Without a master the weights are the kernel's own (read and written); a master writes the rounded
        # weights into the gradient's place (each gradient element is read before its weight overwrites it).
        up_at = 0 if master is not None else wat

        def body(c: int, b: int, e: int) -> None:
            ready = s.ready  # the slot's last upload (read now: the batch before this one has run), whose weights
            if ready is not None:  # are the ones to read here
                ready.synchronize()
            buf, freed = ring.take()
            upload = freed
            try:
                n = e - b
                landed = backend.copy_range_to_host(buf, 0, grad, b, e, after, freed)
                if master is None:
                    landed = backend.copy_range_to_host(buf, wat, param, b, e, after, freed) or landed
                if landed is not None:  # (one copy stream: the last one's event covers both)
                    landed.synchronize()
                t = time.perf_counter()
                g = ring.view(buf, 0, n, s.dtype)
                w = None if master is not None else ring.view(buf, wat, n, s.dtype)
                if s.dtype == "float32":  # the weights are the kernel's fp32 p
                    p, out, okind = w, None, 0
                else:
                    p, out, okind = (None, w, gkind) if master is None else (master.array[b:e], g, gkind)
                K.adamw_chunk(variant, p, m[b:e], v[b:e], g, gkind, out, okind, 0, n, scalars, tc_code, recipe,
                              None if vmax is None else vmax[b:e], _shift(tails, b, e))
                self._stats.add("update_s", time.perf_counter() - t)
                upload = backend.copy_range_to_device(param, b, e, buf, up_at, after)
            finally:
                ring.give(buf, upload)

        def finalize() -> None:
            record = getattr(backend, "record_uploads", None)
            s.ready = record() if record is not None else None
            self._stats.add("param_bytes", s.numel * item)
            self._stats.last_finalize = time.perf_counter()

        self._stats.add("grad_bytes", s.numel * item)
        self._stats.add("eager_updates", int(eager))
        self._unwaited = True
        self._run_batch(s, body, finalize)


class EngineStreaming:
    """The streamed-slot methods of :class:`~trainstream.core._engine.Engine`, by global slot id."""

    def streamed(self, sid: int) -> bool:
        """Whether slot ``sid`` is a host slot with bounded staging."""
        dev, local = self._where[self._check_sid(sid)]
        return not dev and self.host.streamed(local)

    def stream_update(self, sid: int, hp: C.AdamWHyperParams, grad: Any, grad_dtype: str) -> None:
        """Queue the update of streamed host slot ``sid`` from its final gradient ``grad`` now (from a gradient hook;
        not speculative); :meth:`step` then leaves it out."""
        self.host.stream_update(self._local_on(sid, False), hp, grad, grad_dtype, eager=True)
