"""The CUDA calls of offload_adamw's GPU path (trainstream.jax._gpu) simulated on XLA:CPU:
:func:`simulate_gpu` patches them with host stand-ins (mapped memory as NumPy buffers,
copies as memmove, the kernel launches as the host kernel of the same variant). Used by
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


def _load(ptr, n, dtype):
    """float32 values of ``n`` elements of ``dtype`` at ``ptr``."""
    x = _view(ptr, n, _NP[dtype])
    if dtype == "bfloat16":
        return C.bf16_bits_to_f32(x)
    return x.view(np.float16).astype(np.float32) if dtype == "float16" else x.copy()


def _store(ptr, n, dtype, values):
    x = _view(ptr, n, _NP[dtype])
    if dtype == "bfloat16":
        x[:] = C.f32_to_bf16_bits(values)
    else:
        x[:] = np.asarray(values, np.float32).astype(np.float16).view(np.uint16) if dtype == "float16" else values


class _Kernels:
    """launch_adamw_multi / launch_adamw_u_multi on host views: the host kernel of optax/cuda's float32 default lines,
    the contract's NumPy lines (trainstream.contract.optax_cuda_reference_update) for the others and optax's own
    state."""

    MULTI_MAX = 3  # small, so that leaves of one dtype take several launches
    launches = []

    @staticmethod
    def _own_lines(sptr) -> bool:
        """Lines other than the float32 default's (the host kernel's, eps_root included): a code bit."""
        return bool(int(_view(sptr, C.N_SCALARS, np.float32)[C.S_OX_CODE]) & ~C.OX_CLIP)

    @staticmethod
    def _contract(pd, gd, state, item, emit_u):
        """One item by the contract's optax/cuda lines (IEEE stand-ins, as the host kernel's)."""
        param, grad, third, m, v, n, sptr = item
        s = _view(sptr, C.N_SCALARS, np.float32).copy()
        md, vd = state or ("float32", "float32")
        master = state is None and pd != "float32" and not emit_u
        p = _load(third if master else param, n, "float32" if master else pd)
        new_p, mm, vv, u = C.optax_cuda_reference_update(p, _load(m, n, md), _load(v, n, vd), _load(grad, n, gd), s,
                                                         pd)
        _store(m, n, md, mm)
        _store(v, n, vd, vv)
        if emit_u:
            _store(third, n, pd if state == (pd, pd) else "float32", u)
            return
        if master:
            _store(third, n, "float32", new_p)
        _store(param, n, pd, new_p)

    @classmethod
    def launch_adamw_multi(cls, variant, pd, gd, items, stream=0, *, device=None, state=None):
        assert len(items) <= cls.MULTI_MAX and variant == C.VARIANT_OPTAX_CUDA
        cls.launches.append(("w", pd, len(items)) + ((state,) if state else ()))
        for item in items:
            if state is not None or cls._own_lines(item[6]):
                cls._contract(pd, gd, state, item, False)
                continue
            param, grad, master, m, v, n, sptr = item
            s = _view(sptr, C.N_SCALARS, np.float32)
            g = _view(grad, n, _NP[gd])
            if pd == "float32":
                K.adamw_chunk(variant, _view(param, n, np.float32), _view(m, n, np.float32),
                              _view(v, n, np.float32), g, _KIND[gd], None, 0, 0, n, s.copy())
            else:
                K.adamw_chunk(variant, _view(master, n, np.float32), _view(m, n, np.float32),
                              _view(v, n, np.float32), g, _KIND[gd], _view(param, n, np.uint16), _KIND[pd], 0, n,
                              s.copy())

    @classmethod
    def launch_adamw_u_multi(cls, variant, gd, items, stream=0, *, device=None, param_dtype="float32", state=None):
        assert len(items) <= cls.MULTI_MAX and variant == C.VARIANT_OPTAX_CUDA
        cls.launches.append(("u", gd, len(items)) + ((param_dtype, state) if state else ()))
        for item in items:
            if state is not None or cls._own_lines(item[6]):
                cls._contract(param_dtype, gd, state, item, True)
                continue
            param, grad, u, m, v, n, sptr = item
            s = _view(sptr, C.N_SCALARS, np.float32)
            K.adamw_chunk(variant, _view(param, n, np.float32), _view(m, n, np.float32), _view(v, n, np.float32),
                          _view(grad, n, _NP[gd]), _KIND[gd], _view(u, n, np.float32), K.OUT_U, 0, n, s.copy())


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
