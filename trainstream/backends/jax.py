"""The JAX side below the adapter: XLA's buffers as addresses and NumPy views, XLA:GPU's stream and the CUDA
device of a buffer (through :mod:`trainstream._cuda`), and the probe of XLA:CPU's arithmetic (:func:`xla_cpu_fma`).
Nothing of optax's API (``trainstream.jax``) and no torch.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import warnings

import jax
import numpy as np

from .. import _cuda
from .. import contract as C

__all__ = ["buffer_device", "buffer_ptr", "flat_view", "host_view", "stream_of", "xla_cpu_fma"]


def buffer_ptr(buf) -> int:
    """The device address of a buffer XLA:GPU hands to a callback (host memory: its UVA address)."""
    return int(buf.__cuda_array_interface__["data"][0])


def buffer_device(buf) -> int:
    """The CUDA device of such a buffer (GPU resources are keyed by it, never by ``jax.Device.id``)."""
    return _cuda.pointer_device(buffer_ptr(buf))


def stream_of(ctx) -> int:
    """XLA's compute stream of this execution (a ``CUstream``), from a callback's context."""
    return int(ctx.stream)


def flat_view(buf, kind: str) -> np.ndarray:
    """A flat NumPy view of an XLA:CPU buffer as the host kernels read it (uint16 for fp16/bf16)."""
    a = np.asarray(buf).reshape(-1)
    return a.view(np.uint16) if kind != "float32" else a


def host_view(ptr: int, count: int, dtype) -> np.ndarray:
    """A NumPy view (no copy) of ``count`` elements at a host address (pinned host memory: its UVA address); it
    does not keep the memory alive."""
    dtype, count = np.dtype(dtype), int(count)
    if count == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(int(ptr)), dtype, count)


@functools.cache
def xla_cpu_fma() -> bool:
    """Whether XLA:CPU contracts ``a*b + c`` into an FMA (not at ``--xla_cpu_max_isa=SSE4_2``/``AVX``), probed once."""
    rng = np.random.default_rng(5)
    a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    cpu = jax.local_devices(backend="cpu")[0]  # this process's (jax.distributed)
    f = jax.jit(lambda a, b, c: a * b + c)
    # in a thread of its own: none of the caller's trace or mesh context; its errors raise here
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainstream-xla-probe") as pool:
        out = pool.submit(lambda: np.asarray(f(*(jax.device_put(x, cpu) for x in (a, b, c))))).result().view(np.uint32)
    if np.array_equal(out, C.fma_f32(a, b, c).view(np.uint32)):
        return True
    if np.array_equal(out, (a * b + c).view(np.uint32)):
        return False
    warnings.warn("TrainStream: XLA:CPU's a*b + c is neither fused nor two roundings on this host; offload_adamw "
                  "on the CPU may differ from optax.adamw in the last bit", RuntimeWarning, stacklevel=4)
    return True
