"""The CUDA calls of offload_adamw's GPU path (trainstream.jax._gpu) simulated on XLA:CPU:
:func:`simulate_gpu` patches them with host stand-ins (mapped memory as NumPy buffers,
copies as memmove, the kernel launches as the host kernel of the same variant and lines). Used by
tests/test_jax_gpu_plumbing.py and tests/_jax_mesh_scenarios.py (a helper module, not
collected by pytest)."""

import ctypes

import numpy as np

from trainstream import _host_kernels as K
from trainstream import contract as C
from trainstream.backends import jax as XB
from trainstream.jax import _gpu as G
from trainstream.jax import _plan as T
from trainstream.jax import _resident, _transform

_KIND = {"float32": K.KIND_F32, "float16": K.KIND_F16, "bfloat16": K.KIND_BF16}
_NP = {"float32": np.float32, "float16": np.uint16, "bfloat16": np.uint16}


def _view(ptr, n, dtype):
    if n == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(ptr), dtype, n)


class _Mapped:
    live = 0  # bytes allocated and not freed (the plan's figures are checked against it)

    def __init__(self, nbytes):
        self._a = np.zeros(nbytes, np.uint8)
        self.host_ptr = self.dev_ptr = self._a.ctypes.data
        self.nbytes = nbytes
        _Mapped.live += nbytes

    def free(self):
        _Mapped.live -= self.nbytes
        self.nbytes = 0


class _Context:
    copies = []
    waits = []  # (stream, event): the staging ring's orders

    def alloc_mapped(self, nbytes):
        return _Mapped(nbytes)

    streams = iter(range(7, 1 << 30))

    def create_stream(self):
        return next(_Context.streams)

    def destroy_stream(self, stream):
        pass

    def stream_synchronize(self, stream):
        pass

    def stream_wait_event(self, stream, event):
        self.waits.append((stream, event))

    def memcpy_dtoh_async(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        self.copies.append(("d2h", nbytes))

    def memcpy_htod_async(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        self.copies.append(("h2d", nbytes))


class _Event:
    def __init__(self, ctx, stream):
        self.stream = stream

    def synchronize(self):
        pass

    def query(self):
        return True


class _Device:
    """Device memory of the staging ring: host memory (the simulated copies memmove)."""

    def __init__(self, nbytes):
        self._a = np.full(nbytes // 4, np.nan, np.float32)
        self.dev_ptr, self.nbytes = self._a.ctypes.data, nbytes

    def free(self):
        pass


class _Kernels:
    """launch_adamw_multi / launch_adamw_u_multi on host views: the host kernel of optax/cuda's lines (the
    contract's in IEEE arithmetic, trainstream._host_kernels._optax), optax's own state included."""

    MULTI_MAX = 3  # small, so that leaves of one dtype take several launches
    launches = []

    @staticmethod
    def _run(variant, pd, gd, state, item, emit_u):
        param, grad, third, m, v, n, sptr = item
        md, vd = state or ("float32", "float32")
        if state is None and pd != "float32" and not emit_u:  # the fp32 master, the rounded weights out
            p, out, okind = _view(third, n, np.float32), _view(param, n, np.uint16), _KIND[pd]
        elif emit_u:  # u in optax's update dtype
            p, out, okind = _view(param, n, _NP[pd]), _view(third, n, _NP[pd if state == (pd, pd) else "float32"]), \
                K.OUT_U
        else:  # the weights in place
            p, out, okind = _view(param, n, _NP[pd]), None, 0
        K.adamw_chunk(variant, p, _view(m, n, _NP[md]), _view(v, n, _NP[vd]), _view(grad, n, _NP[gd]), _KIND[gd], out,
                      okind, 0, n, _view(sptr, C.N_SCALARS, np.float32).copy())

    @classmethod
    def launch_adamw_multi(cls, variant, pd, gd, items, stream=0, *, device=None, state=None):
        assert len(items) <= cls.MULTI_MAX and variant == C.VARIANT_OPTAX_CUDA
        cls.launches.append(("w", pd, len(items)) + ((state,) if state else ()))
        for item in items:
            cls._run(variant, pd, gd, state, item, False)

    @classmethod
    def launch_adamw_u_multi(cls, variant, gd, items, stream=0, *, device=None, param_dtype="float32", state=None):
        assert len(items) <= cls.MULTI_MAX and variant == C.VARIANT_OPTAX_CUDA
        cls.launches.append(("u", gd, len(items)) + ((param_dtype, state) if state else ()))
        for item in items:
            cls._run(variant, param_dtype, gd, state, item, True)


def simulate_gpu(monkeypatch):
    """Patch the CUDA calls of the GPU path with their host simulations (a generator: the
    fixture below, and tests/_jax_mesh_scenarios.py with a MonkeyPatch of its own)."""
    from trainstream import _cuda
    from trainstream import _device_kernels as dk
    from trainstream.core import _hostring, _ring

    monkeypatch.setattr(_transform, "_platform_of", lambda leaves: "cuda")
    monkeypatch.setattr(_resident, "platform_of", lambda leaves: "cuda")
    monkeypatch.setattr(XB, "buffer_ptr", lambda buf: int(np.asarray(buf).ctypes.data))
    monkeypatch.setattr(XB, "stream_of", lambda ctx: 0)
    monkeypatch.setattr(_cuda, "pointer_device", lambda ptr: 0)
    monkeypatch.setattr(_cuda, "context", lambda device: _Context())
    monkeypatch.setattr(_cuda, "Event", _Event)
    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "alloc_device", lambda nbytes, device=None: _Device(nbytes))
    monkeypatch.setattr(G, "_device_engines", {})  # an engine (and ring) of the simulated device, not a real one
    monkeypatch.setattr(G, "_host_rings", {})  # mode="cpu"'s staging ring, likewise
    monkeypatch.setattr(_ring, "RING_ELEMS", 512)  # small: leaves in pieces, several buffers per update
    for name, value in (("HOST_RING_ELEMS", 256), ("HOST_RING_DEPTH", 3), ("_ALIGN", 16)):  # mode="cpu" likewise
        monkeypatch.setattr(_hostring, name, value)
    for name in ("launch_adamw_multi", "launch_adamw_u_multi", "MULTI_MAX"):
        monkeypatch.setattr(dk, name, getattr(_Kernels, name))
    _Kernels.launches.clear()
    _Context.copies.clear()
    _Context.waits.clear()
    with T._plans_lock:  # plans of the real platform must not serve the simulated one
        T._plans.clear()
    yield
    with T._plans_lock:
        T._plans.clear()
