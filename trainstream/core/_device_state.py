"""The device placement's slots and their state buffers (:mod:`trainstream.core._device`): allocation in mapped pinned
host memory or GPU memory, in the state dtype of the slot's recipe (fp32, or the uint16 bits of fp16/bf16), and the
state as a dict (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad, ``master`` with one).
Imports neither torch nor jax."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _device_recipes as R
from .. import contract as C

__all__ = ["Buf", "GpuSlot", "STATE_KEYS", "storage_dtype", "alloc_buf", "read_buf", "write_buf", "to_storage",
           "check_state"]

#: The state arrays of a slot, in the order the ring stages them (master last).
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")


def storage_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype holding a state array of ``dtype``: float32, or uint16 (the fp16/bf16 bits)."""
    return np.dtype(np.float32) if dtype == "float32" else np.dtype(np.uint16)


@dataclass(eq=False)
class Buf:
    """One state buffer: mapped host memory (``host``, a view at ``host_ptr``), or resident GPU memory (``mem``); the
    kernels take ``dev_ptr``. ``dtype``: its state dtype (float32, float16, bfloat16)."""

    host: np.ndarray | None
    dev_ptr: int
    free: Callable[[], None]
    nbytes: int
    dtype: str
    mem: Any = None
    host_ptr: int = 0

    @property
    def itemsize(self) -> int:
        return C.ITEMSIZE[self.dtype]


@dataclass(eq=False)
class GpuSlot:
    id: int
    param: Any
    numel: int
    dtype: str
    recipe: Any  # TorchRecipe; None: the optax convention's kernels (fp32 state, a master for 16-bit weights)
    exp_avg: Buf
    exp_avg_sq: Buf
    max_exp_avg_sq: Buf | None
    master: Buf | None
    step: int = 0
    ready: Any = None  # the weights are updated (compute waits on it)
    grad_keep: Any = None
    copied_back: Any = None  # staged: the state is back in host memory

    def bufs(self) -> dict[str, Buf]:
        """The slot's state buffers by :data:`STATE_KEYS` name (those it has)."""
        return {k: b for k in STATE_KEYS if (b := getattr(self, k)) is not None}

    def settle(self) -> None:
        for ev in (self.ready, self.copied_back):
            if ev is not None:
                ev.synchronize()


def alloc_buf(dk, device: int, numel: int, dtype: str, what: str, owned: list, gpu_state: bool) -> Buf:
    """A state buffer of ``numel`` elements of ``dtype`` (``owned`` collects it; ``MemoryError`` naming ``what``)."""
    nbytes = max(4, -(-numel * C.ITEMSIZE[dtype] // 4) * 4)  # whole 4-byte words: DeviceMemory.zero sets words
    try:
        if gpu_state:
            mem = dk.alloc_device(nbytes, device)
            buf = Buf(None, mem.dev_ptr, mem.free, nbytes, dtype, mem)
        else:
            host_ptr, dev_ptr, free = dk.alloc_mapped(nbytes, device)
            buf = Buf(dk.host_view(host_ptr, numel, storage_dtype(dtype)), dev_ptr, free, nbytes, dtype,
                      host_ptr=host_ptr)
    except MemoryError as exc:
        where = "GPU-resident state (gpu_state_bytes)" if gpu_state else "gpu mode"
        raise MemoryError(f"TrainStream {where}, {what}: {exc}") from exc
    owned.append(buf)
    return buf


def read_buf(buf: Buf, numel: int, stream: int, copy: bool = True) -> np.ndarray:
    """The buffer's values (its storage dtype): mapped memory as a view (``copy=False``) or a copy; resident memory
    copied to the host on ``stream``."""
    if buf.host is not None:
        return buf.host.copy() if copy else buf.host
    out = np.empty(numel, storage_dtype(buf.dtype))
    buf.mem.to_host(out.ctypes.data, out.nbytes, stream)
    return out


def write_buf(buf: Buf, values: np.ndarray, stream: int) -> None:
    """Write storage-dtype ``values`` (:func:`to_storage`) into the buffer (resident: copied on ``stream``)."""
    if buf.host is not None:
        buf.host[:] = values
        return
    a = np.ascontiguousarray(values)
    buf.mem.from_host(a.ctypes.data, a.nbytes, stream)


def to_storage(values, dtype: str) -> np.ndarray:
    """State values as ``dtype``'s storage: float32, or uint16 bits (given as bits, or as floats rounded to the dtype
    to nearest even: exact for values of the dtype)."""
    a = np.asarray(values)
    if dtype != "float32" and a.dtype == np.uint16:
        return a.reshape(-1)
    return R._round_to_state(a.astype(np.float32, copy=False), dtype)


def check_state(slot: GpuSlot, state: Mapping) -> int:
    """Check a state dict against the slot before anything is written: its keys (``max_exp_avg_sq`` exactly with
    amsgrad; ``master`` optional, only for a slot with one), every array's size, ``step`` a non-negative integer.
    Returns the step."""
    if not isinstance(state, Mapping):
        raise TypeError(f"load_state takes a dict of the slot's state, got {type(state).__name__}")
    need = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if slot.max_exp_avg_sq is not None else set())
    allowed = need | ({"master"} if slot.master is not None else set())
    keys = {k for k, v in state.items() if v is not None}
    if not need <= keys or not keys <= allowed:
        raise ValueError(f"load_state: parameter slot {slot.id} ({slot.recipe!r}) takes {sorted(need)}"
                         f"{' and optionally master' if slot.master is not None else ''}; got {sorted(keys)}")
    for k in keys - {"step"}:
        if np.asarray(state[k]).size != slot.numel:
            raise ValueError(f"load_state: {k} of parameter slot {slot.id} has {np.asarray(state[k]).size} "
                             f"elements, the parameter {slot.numel}")
    step = state["step"]
    if isinstance(step, bool) or not float(step).is_integer() or int(step) < 0:
        raise ValueError(f"load_state: step must be a non-negative integer, got {step!r}")
    return int(step)
