"""The JAX adapter's CUDA side: engine backends whose stream is XLA's.

Under ``jax.jit`` on a GPU, XLA:GPU calls the adapter's FFI handler on the host while it
enqueues the program on its compute stream; the handler gets that stream
(``XLA_FFI_Stream_Get``) and device pointers. Everything here is ordered on that stream,
so XLA's own ordering (the gradients before the update, the update before the next
forward) holds without extra events on the compute side.

* :class:`JaxCudaHostBackend` (``mode="cpu"``): the :class:`~trainstream.core._engine.Engine`
  backend. Gradients are copied into pinned staging on XLA's stream (one event per
  leaf, which the engine's workers wait on), the host update runs on the workers, and
  each leaf's new weights are uploaded on XLA's stream from the worker that finished
  it. The handler returns when the host work is done; the uploads are queued, and XLA's
  next operations on the stream run after them.
* :class:`JaxGpuBackend` (``mode="gpu"``): the :class:`~trainstream.core._engine.Engine`'s device placement
  backend; its kernels are launched on XLA's stream by
  :meth:`~trainstream.core._engine.Engine.step_external`.

CuPy is imported lazily (``trainstream._device_kernels``). No arithmetic lives here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _cuda
from .. import _device_kernels as dk

__all__ = ["CountCheck", "DeviceRef", "JaxCudaHostBackend", "JaxGpuBackend", "device_synchronize"]

_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


class DeviceRef:
    """A device buffer lent by XLA for one handler call: a pointer and its size."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)


class _PinnedBuffer:
    """A flat buffer of mapped pinned host memory (the engine's ``HostBuffer``)."""

    __slots__ = ("array", "handle", "pinned", "ptr", "_mem", "__weakref__")

    def __init__(self, numel: int, dtype, device: int, what: str):
        dt = np.dtype(dtype)
        try:
            self._mem = _cuda.context(device).alloc_mapped(max(16, numel * dt.itemsize))
        except MemoryError as exc:
            raise MemoryError(f"TrainStream could not allocate pinned host memory for {what}: {exc}") from exc
        self.ptr = self._mem.host_ptr
        self.array = dk.host_view(self.ptr, numel, dt)
        self.handle = self
        self.pinned = True

    def __del__(self):
        self.array = None  # the view goes before the memory (Mapped frees itself when collected)


def _event(stream: int, device: int) -> _cuda.Event:
    """A CUDA event recorded on ``stream`` (blocking sync: waiters sleep, not spin)."""
    return _cuda.Event(_cuda.context(device), stream)


def _memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int, device: int) -> None:
    if nbytes <= 0:
        return
    ctx = _cuda.context(device)
    if kind == _H2D:
        ctx.memcpy_htod_async(int(dst), int(src), int(nbytes), int(stream))
    else:
        ctx.memcpy_dtoh_async(int(dst), int(src), int(nbytes), int(stream))


def device_synchronize(device: int) -> None:
    """Wait for all work on ``device`` (before the host reads or writes the gpu-mode state)."""
    _cuda.context(device).synchronize()


class JaxCudaHostBackend:
    """:class:`~trainstream.core._engine.Backend` for JAX arrays on a CUDA device (``cpu`` mode).

    ``stream`` is set by the FFI handler before each update (XLA's stream of that call);
    ``param`` objects are the adapter's leaves, whose ``out_ptr`` is the device address
    of this call's output buffer and ``init`` the float32 weights at registration.
    """

    def __init__(self, device: int):
        self.device = int(device)
        self.stream = 0
        _cuda.context(self.device)  # fail early when the CUDA driver cannot be used

    def host_empty(self, numel: int, dtype: str, *, pinned: bool, what: str):
        np_dtype = np.float32 if dtype == "float32" else np.uint16
        if pinned:
            return _PinnedBuffer(numel, np_dtype, self.device, what)
        from ._transform import _aligned_empty, _HostBuffer  # noqa: PLC0415 (circular at import time)

        try:
            return _HostBuffer(_aligned_empty((numel,), np_dtype, huge=True))  # 2 MiB pages
        except (MemoryError, OSError) as exc:  # OSError: mmap (trainstream._hostmem)
            nbytes = numel * np.dtype(np_dtype).itemsize
            raise MemoryError(f"TrainStream could not allocate {nbytes} bytes of host memory for {what}") from exc

    def param_to_host_f32(self, param: Any, out: np.ndarray) -> None:
        out[:] = param.init

    def record_compute(self, param: Any) -> None:
        return None  # one stream: XLA's

    def copy_to_host(self, dst, src: DeviceRef, after: Any) -> _cuda.Event:
        if not isinstance(dst, _PinnedBuffer):
            raise TypeError("gradient staging must be pinned host memory")
        if src.nbytes != dst.array.nbytes:
            raise ValueError(f"gradient of {src.nbytes} bytes for a staging buffer of {dst.array.nbytes}")
        _memcpy_async(dst.ptr, src.ptr, src.nbytes, _D2H, self.stream, self.device)
        return _event(self.stream, self.device)

    def copy_to_device(self, dst: Any, src, after: Any) -> _cuda.Event | None:
        if dst.out_ptr is None:
            return None
        if not isinstance(src, _PinnedBuffer):
            raise TypeError("weights are uploaded from pinned host memory only")
        _memcpy_async(dst.out_ptr, src.ptr, src.array.nbytes, _H2D, self.stream, self.device)
        return _event(self.stream, self.device)

    def wait_on_compute(self, event: Any, param: Any) -> None:
        pass  # XLA's stream already orders the next use after the upload

    def all_reduce_sum(self, value: float) -> float:
        return value

    def read_small(self, src: int, nbytes: int) -> np.ndarray:
        """Copy ``nbytes`` from device memory, ordered on the stream, and wait for them
        (the wait covers all the program before this call: the gradients are ready)."""
        buf = self._small if getattr(self, "_small", None) is not None else None
        if buf is None or buf.array.nbytes < nbytes:
            buf = self._small = _PinnedBuffer(max(64, nbytes), np.uint8, self.device, "FFI scalars")
        _memcpy_async(buf.ptr, src, nbytes, _D2H, self.stream, self.device)
        _cuda.context(self.device).stream_synchronize(int(self.stream))
        return buf.array[:nbytes].copy()


class CountCheck:
    """Asynchronous read-back of the optimizer count for ``mode="gpu"``.

    Each update copies the count its program passed (a device int32) into a slot of a
    pinned ring on XLA's stream and records an event; :meth:`completed` returns
    ``(count, updates done before that call)`` for the copies that have landed (all of
    them with ``block=True``). A full ring waits for its oldest copy.
    """

    SLOTS = 64

    def __init__(self, device: int):
        self.device = device
        self._ring = _PinnedBuffer(self.SLOTS, np.int32, device, "optimizer count read-back")
        self._pending: list = []  # (event, slot, updates done before that call)
        self._landed: list = []  # (count, done) read from slots reused before a check
        self._next = 0

    def enqueue(self, count_ptr: int, done: int, stream: int) -> None:
        if len(self._pending) >= self.SLOTS:  # full: the oldest copy holds the slot we reuse
            ev, old_slot, old_done = self._pending.pop(0)
            ev.synchronize()
            self._landed.append((int(self._ring.array[old_slot]), old_done))
        slot = self._next % self.SLOTS
        self._next += 1
        _memcpy_async(self._ring.ptr + 4 * slot, count_ptr, 4, _D2H, stream, self.device)
        self._pending.append((_event(stream, self.device), slot, done))

    def completed(self, block: bool) -> list[tuple[int, int]]:
        out, self._landed = self._landed, []
        while self._pending:
            ev, slot, done = self._pending[0]
            if block:
                ev.synchronize()
            elif not ev.query():
                break
            self._pending.pop(0)
            out.append((int(self._ring.array[slot]), done))
        return out


class JaxGpuBackend:
    """The :class:`~trainstream.core._engine.Engine`'s device placement backend for JAX (``gpu`` mode).

    Only what :meth:`~trainstream.core._engine.Engine.step_external` and the state
    functions use: the device, the initial weights of fp16/bf16 leaves (for their fp32
    master) and a device scratch allocation.
    """

    def __init__(self, device: int):
        self.device_index = int(device)
        self._scratch: list = []

    def param_to_host_f32(self, param: Any, out: np.ndarray) -> None:
        if param.init is None:
            raise ValueError(
                "TrainStream gpu mode: the float32 weights of this leaf live in the parameters "
                "themselves (they are their own master); pass params to state_dict"
            )
        out[:] = param.init

    def count_checker(self) -> CountCheck:
        return CountCheck(self.device_index)

    def device_scratch(self, nbytes: int) -> tuple[Any, int]:
        cp = dk._cupy()
        with cp.cuda.Device(self.device_index):
            mem = cp.cuda.alloc(int(nbytes))
        self._scratch.append(mem)
        return mem, int(mem.ptr)

    def record_compute(self, param: Any) -> None:
        return None

    def update_wait(self, event: Any) -> None:
        pass

    def wait_on_compute(self, event: Any, param: Any) -> None:
        pass
