"""What the engine needs from a framework: the interface that each backend of ``trainstream/backends/`` implements
(:class:`~trainstream.backends.torch.TorchBackend`). An engine without a backend holds no parameters; it updates
buffers the caller owns (:mod:`trainstream.core._external`). No torch or jax import.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["Backend", "DeviceBackend", "Event", "HostBuffer"]


class HostBuffer(Protocol):
    """A flat host buffer of a backend: ``array`` is a writable NumPy view (float32, or the uint16
    bits of fp16/bf16), ``handle`` the framework object for copies (e.g. a pinned torch tensor)."""

    array: np.ndarray
    handle: Any
    pinned: bool


class Event(Protocol):
    def synchronize(self) -> None: ...


class Backend(Protocol):
    """What the host placement (:mod:`trainstream.core._host`) needs. Optional attributes:
    ``weights_in_grad_stage`` (that module's docstring, 3.) and ``copy_keeps_source_alive``."""

    def host_empty(self, numel: int, dtype: str, *, pinned: bool, what: str) -> HostBuffer:
        """A new host buffer; raises ``MemoryError`` naming ``what`` and the bytes."""

    def param_to_host_f32(self, param: Any, out: np.ndarray) -> None:
        """Copy the (flat) parameter into ``out`` (float32), synchronously."""

    def record_compute(self, param: Any) -> Event | None:
        """An event marking the current point of the compute stream of ``param``."""

    def copy_to_host(self, dst: HostBuffer, src: Any, after: Event | None, *,
                     free: Event | None = None) -> Event | None:
        """Start ``dst <- src`` (device tensor) after ``after``; return its completion event. ``free``
        (with ``weights_in_grad_stage``): an upload reading ``dst``, which the copy must follow. With
        ``copy_keeps_source_alive`` the backend keeps ``src`` alive until the copy completed."""

    def copy_to_device(self, dst: Any, src: HostBuffer, after: Event | None) -> Event | None:
        """Start ``dst (param) <- src`` after ``after``; return its completion event."""

    def wait_on_compute(self, event: Event | None, param: Any) -> None:
        """Make the compute stream of ``param`` wait for ``event`` (no host block)."""

    def record_uploads(self) -> Event | None:
        """Optional: an event after every weight upload queued so far (None: nothing to wait for);
        without it ``HostPlacement.wait_step`` waits for each slot's last upload event."""

    def copy_range_to_host(self, dst: HostBuffer, offset: int, src: Any, begin: int, end: int, after: Event | None,
                           free: Event | None = None) -> Event | None:
        """Optional (streamed slots, :mod:`trainstream.core._stream`): start ``dst[offset bytes:] <- src[begin:end]``
        (a flat device tensor) after ``after`` and ``free`` (an upload reading that part of ``dst``); return its
        completion event (None: done). ``src`` must stay alive until that event: the caller holds it."""

    def copy_range_to_device(self, dst: Any, begin: int, end: int, src: HostBuffer, offset: int,
                             after: Event | None) -> Event | None:
        """Optional (streamed slots): start ``dst[begin:end] <- src[offset bytes:]`` (``dst``: a flat parameter)
        after ``after``; return its completion event (None: done)."""


class DeviceBackend(Protocol):
    """What the device placement (:mod:`trainstream.core._device`) needs for its slots, besides :class:`Backend`'s
    ``param_to_host_f32``, ``record_compute`` and ``wait_on_compute``."""

    device_index: int  # the CUDA device of the parameters

    def update_stream(self) -> int:
        """The stream (a ``cudaStream_t``) the update kernels run on."""

    def update_wait(self, event: Event) -> None:
        """Make the update stream wait for ``event`` (no host block)."""

    def record_update(self) -> Event:
        """An event marking the current point of the update stream."""

    def data_ptr(self, tensor: Any) -> int:
        """The device address of a contiguous tensor."""
