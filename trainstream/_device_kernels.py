"""CuPy loader and launcher of the ``gpu`` mode kernels (the checkout's ``kernels/adamw.cu``, installed as the package
data ``trainstream/kernels/adamw.cu``: the cuda platform's arithmetic of each :mod:`trainstream.contract` convention,
torch/cuda and optax/cuda; the cpu platforms' is the host kernels'): compiled once per device, launched
asynchronously on raw pointers and a raw ``cudaStream_t`` (a plain ``int``: ``0`` the legacy default stream, torch's
``cuda_stream``, CuPy's ``ptr``, XLA's stream of an FFI handler); the caller orders the launches against the
gradient's producers and the weights' readers. State pointers address mapped pinned host memory or GPU memory. CuPy
is imported on first use (an ``ImportError`` names the extras ``trainstream[cuda12]`` / ``trainstream[cuda13]``); no
torch or jax import.

Compilation: NVRTC (``cupy.RawModule``, :data:`COMPILE_OPTIONS`; CuPy caches the binary in ``~/.cupy/kernel_cache``).
The kernels write every operation as an ``_rn`` intrinsic (the contract's roundings), which ``-fmad`` and ``-prec-*``
do not touch; ``--ftz`` does (pinned false); ``--fmad=false`` guards a future line written without an intrinsic.

Errors: a refused launch raises ``RuntimeError`` naming the kernel. A fault inside a kernel surfaces asynchronously, at
the next synchronising CUDA call on that device, from whichever library makes it; ``TRAINSTREAM_SYNC_LAUNCHES=1`` (or
:func:`set_sync_launches`) synchronises after every launch, raising at the one that faulted; :func:`check_stream` once.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import threading
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np

from . import _cuda
from . import contract as C

__all__ = ["ADAMW_SOURCE", "kernel_source", "ADAMW_THREADS", "DTYPES", "adamw_kernel_name", "check_kernel_constants",
           "compile_kernels", "launch_adamw", "launch_adamw_multi", "launch_adamw_u_multi", "U_VARIANTS",
           "adamw_u_kernel_name", "MULTI_MAX", "alloc_mapped", "alloc_device", "host_view", "check_stream",
           "set_sync_launches"]

#: The CUDA source (:func:`kernel_source`).
ADAMW_SOURCE = "adamw.cu"

#: Block size; the .cu file defines the same number (checked at load time).
ADAMW_THREADS = 256

COMPILE_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

DTYPES = ("float32", "float16", "bfloat16")
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_DTYPE_ALIASES = {**{d: d for d in DTYPES}, "float": "float32", "fp32": "float32", "f32": "float32",
                  "half": "float16", "fp16": "float16", "f16": "float16", "bf16": "bfloat16"}
#: The variants with CUDA kernels (``TS_VARIANT_*`` in the source): the cuda platform of each convention.
_VARIANT_NAMES = {C.VARIANT_TORCH_CUDA: "torch_cuda", C.VARIANT_OPTAX_CUDA: "optax_cuda"}
_HOST_ONLY = {C.VARIANT_TORCH_CPU: "torch/cpu", C.VARIANT_OPTAX_CPU: "optax/cpu"}


class _Scalars(ctypes.Structure):
    """``struct TsScalars { float s[TS_N_SCALARS]; }``: the kernel's by-value scalar parameter."""
    _fields_ = [("s", ctypes.c_float * C.N_SCALARS)]


#: Tensors per multi-tensor launch (``TS_MULTI_MAX`` in the kernel source).
MULTI_MAX = 32
#: ``block_start`` of a launch's unused items (``TS_UNUSED_BLOCK``): above every block index.
_UNUSED_BLOCK = 2**31 - 1


class _MultiItem(ctypes.Structure):
    """``struct TsMultiItem``: one tensor of a launch (128 bytes)."""
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("master", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("v", ctypes.c_void_p), ("n", ctypes.c_longlong),
                ("block_start", ctypes.c_int), ("nblocks", ctypes.c_int), ("scalars", _Scalars),
                ("scalars_dev", ctypes.c_void_p)]


class _MultiBatch(ctypes.Structure):
    """``struct TsMultiBatch``: the kernel's by-value parameter (4096 bytes, the 4 KiB that every
    CUDA driver accepts for a launch's parameters); the unused items after the tensors have
    ``block_start`` :data:`_UNUSED_BLOCK`."""
    _fields_ = [("items", _MultiItem * MULTI_MAX)]


# -- CuPy, lazily --------------------------------------------------------------------------
@functools.cache
def _cupy():
    try:
        import cupy  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("TrainStream's gpu (zero-copy) mode needs CuPy, which is not installed: install the "
                          "extra matching your CUDA driver, `pip install trainstream[cuda12]` (cupy-cuda12x) or "
                          f"`pip install trainstream[cuda13]` (cupy-cuda13x). ({e})") from e
    return cupy


_sync_launches = os.environ.get("TRAINSTREAM_SYNC_LAUNCHES", "") not in ("", "0")


def set_sync_launches(enabled: bool) -> None:
    """Synchronise the stream after every launch (debugging: faults raise at the launch)."""
    global _sync_launches
    _sync_launches = bool(enabled)


# -- the sources and their constants -------------------------------------------------------
def kernel_source(name: str) -> str:
    """The text of the CUDA source ``name`` (:data:`ADAMW_SOURCE`; no GPU needed), read from the package data
    ``trainstream/kernels/`` (a wheel, also read-only, or a strict editable install: setuptools maps the checkout's
    top-level ``kernels/`` there), else from the top-level ``kernels/`` of the source checkout this package is in (a
    checkout on ``sys.path``, or setuptools' default editable install, which imports the checkout's ``trainstream/``).
    ``FileNotFoundError`` naming the places looked at if absent."""
    packaged = resources.files("trainstream") / "kernels" / name
    places = [packaged]
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file():  # a source checkout, not site-packages
        places.append(root / "kernels" / name)
    for path in places:
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            continue
    raise FileNotFoundError(f"TrainStream CUDA source {name} not found in {', '.join(map(str, places))}: the "
                            f"install lacks the package data trainstream/kernels/{name}; reinstall from the wheel or "
                            "the checkout")


_DEFINE = re.compile(r"^#define\s+(TS_\w+)\s+(\d+)\s*$", re.MULTILINE)


def check_kernel_constants() -> None:
    """Check the ``#define``\\ s of the .cu file against :mod:`trainstream.contract`: every scalar index (``TS_S_*``,
    ``TS_N_SCALARS``), the variants of :func:`adamw_kernel_name` (``TS_VARIANT_*``) and ``TS_OX_CLIP`` (the one optax
    code bit the cuda platform reads) must be defined with the contract's value, any other ``TS_OX_*`` too; also
    :data:`ADAMW_THREADS` and the launch layout (``TS_MULTI_MAX``, ``TS_UNUSED_BLOCK``). ``RuntimeError`` listing
    every difference (no GPU)."""
    adamw = {k: int(v) for k, v in _DEFINE.findall(kernel_source(ADAMW_SOURCE))}
    contract = {"TS_" + name: getattr(C, name) for name in dir(C)
                if name.startswith(("S_", "VARIANT_", "OX_")) and isinstance(getattr(C, name), int)}
    required = {"TS_N_SCALARS": C.N_SCALARS, "TS_ADAMW_THREADS": ADAMW_THREADS, "TS_MULTI_MAX": MULTI_MAX,
                "TS_UNUSED_BLOCK": _UNUSED_BLOCK, "TS_OX_CLIP": C.OX_CLIP}
    required.update({k: v for k, v in contract.items() if k.startswith("TS_S_")})
    required.update({f"TS_VARIANT_{name.upper()}": v for v, name in _VARIANT_NAMES.items()})
    problems = [f"{ADAMW_SOURCE}: {key} is {adamw.get(key)}, the contract says {want}"
                for key, want in sorted({**contract, **required}.items())
                if (key in required or key in adamw) and adamw.get(key) != want]
    problems += [f"{ADAMW_SOURCE}: {key} has no counterpart in trainstream.contract" for key in sorted(adamw)
                 if key.startswith(("TS_S_", "TS_VARIANT_", "TS_OX_")) and key not in contract]
    if problems:
        raise RuntimeError("TrainStream kernels out of sync with the contract:\n  " + "\n  ".join(problems))


def _dtype_name(dtype) -> str:
    """'float32' / 'float16' / 'bfloat16' from a string, NumPy, ml_dtypes, torch or JAX dtype."""
    s = dtype
    if not isinstance(dtype, str):
        try:
            s = np.dtype(dtype).name
        except TypeError:
            s = str(dtype)
    s = s.lower().removeprefix("torch.").removeprefix("jnp.")
    try:
        return _DTYPE_ALIASES[s]
    except KeyError:
        raise ValueError(f"Unsupported dtype {dtype!r}; expected one of {DTYPES}") from None


def _check_variant(variant, variants) -> None:
    """``ValueError`` unless ``variant`` is one of ``variants`` (a host-only variant named as such)."""
    if variant in variants:
        return
    if variant in _HOST_ONLY:
        raise ValueError(f"kernel variant {variant!r} ({_HOST_ONLY[variant]}) has no CUDA kernel: a GPU computes the "
                         f"cuda platform's arithmetic (variants {sorted(variants)}); the host kernels the cpu's")
    raise ValueError(f"Unknown kernel variant {variant!r}; expected one of {sorted(variants)}")


def adamw_kernel_name(variant: int, param_dtype, grad_dtype) -> str:
    """The ``extern "C"`` name of the AdamW kernel for a variant (:data:`trainstream.contract.VARIANT_TORCH_CUDA` or
    ``VARIANT_OPTAX_CUDA``) and two dtypes."""
    _check_variant(variant, _VARIANT_NAMES)
    return (f"adamw_{_VARIANT_NAMES[variant]}_"
            f"{_SUFFIX[_dtype_name(param_dtype)]}_{_SUFFIX[_dtype_name(grad_dtype)]}")


#: The variants with a kernel that writes optax's ``u`` (:func:`launch_adamw_u_multi`).
U_VARIANTS = (C.VARIANT_OPTAX_CUDA,)


def adamw_u_kernel_name(variant: int, grad_dtype) -> str:
    """The ``extern "C"`` name of the kernel that writes ``u`` of float32 weights (optax)."""
    if variant not in U_VARIANTS and variant in _VARIANT_NAMES:
        raise ValueError(f"variant {variant!r} has no kernel that writes u; expected one of {U_VARIANTS}")
    _check_variant(variant, U_VARIANTS)
    return f"adamw_u_{_VARIANT_NAMES[variant]}_f32_{_SUFFIX[_dtype_name(grad_dtype)]}"


# -- compilation, once per device ----------------------------------------------------------
class _Kernel(NamedTuple):
    name: str
    function: object  # keeps the CUmodule loaded
    ptr: int
    max_grid: int  # blocks resident at once on the whole device


_lock = threading.Lock()
_modules: dict[str, object] = {}
_kernels: dict[int, dict[str, _Kernel]] = {}


def _device_index(device: int | None) -> int:
    """``device`` as an int; None: CuPy's current device."""
    return int(_cupy().cuda.runtime.getDevice()) if device is None else int(device)


def multiprocessor_count(device: int | None = None) -> int:
    """The number of streaming multiprocessors of ``device`` (default: the current one)."""
    return int(_cupy().cuda.Device(_device_index(device)).attributes["MultiProcessorCount"])


def compile_kernels(device: int | None = None) -> dict[str, int]:
    """Compile and load every kernel on ``device`` (default: the current one; idempotent, thread-safe, called by
    the launchers). Returns ``{name: resident blocks}`` (occupancy x multiprocessors), the launches' grid cap."""
    cp = _cupy()
    dev = _device_index(device)
    with _lock:
        if dev not in _kernels:
            check_kernel_constants()
            if not _modules:
                _modules["adamw"] = cp.RawModule(code=kernel_source(ADAMW_SOURCE), options=COMPILE_OPTIONS)
            names = ([adamw_kernel_name(v, p, g) for v in _VARIANT_NAMES for p in DTYPES for g in DTYPES]
                     + [adamw_u_kernel_name(v, g) for v in U_VARIANTS for g in DTYPES])
            table = {}
            with cp.cuda.Device(dev):
                sm_count = multiprocessor_count(dev)
                for name in names:
                    function = _modules["adamw"].get_function(name).kernel  # compiles once
                    per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, ADAMW_THREADS, 0)
                    table[name] = _Kernel(name, function, int(function.ptr), max(1, per_sm) * sm_count)
            _kernels[dev] = table
    return {k: v.max_grid for k, v in _kernels[dev].items()}


def _kernel(device: int, name: str) -> _Kernel:
    if device not in _kernels:
        compile_kernels(device)
    return _kernels[device][name]


def _launch(device: int, kernel: _Kernel, grid: int, block: int, args: list, stream: int) -> None:
    cp = _cupy()
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    what = f"{kernel.name} (grid {grid} x {block}, stream {int(stream):#x})"
    with cp.cuda.Device(device):
        # a thread without a current context (e.g. XLA's): any runtime call makes the primary context current
        if cp.cuda.driver.ctxGetCurrent() == 0:
            cp.cuda.runtime.setDevice(device)
            cp.cuda.runtime.free(0)
        try:
            cp.cuda.driver.launchKernel(kernel.ptr, grid, 1, 1, block, 1, 1, 0, int(stream),
                                        ctypes.addressof(params), 0)
        except cp.cuda.driver.CUDADriverError as e:
            raise RuntimeError(f"TrainStream: launching {what} on cuda:{device} failed: {e}") from e
        if _sync_launches:
            check_stream(stream, device, _after=what)


def check_stream(stream: int = 0, device: int | None = None, *, _after="the launches queued on this stream") -> None:
    """Synchronise ``stream`` and raise ``RuntimeError`` for an asynchronous kernel fault."""
    cp = _cupy()
    dev = _device_index(device)
    with cp.cuda.Device(dev):
        try:
            cp.cuda.runtime.streamSynchronize(int(stream))
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise RuntimeError(f"TrainStream: CUDA error on cuda:{dev} after {_after}: {e}") from e


def _check_ptr(name: str, ptr, align: int, allow_null: bool = False) -> int:
    ptr = int(ptr or 0)
    if ptr == 0 and not allow_null:
        raise ValueError(f"{name} is a null pointer")
    if ptr < 0:
        raise ValueError(f"{name} = {ptr} is not a pointer")
    if ptr % align:
        raise ValueError(f"{name} = {ptr:#x} is not {align}-byte aligned")
    return ptr


# -- AdamW ---------------------------------------------------------------------------------
def _grid_for(n: int, max_grid: int) -> int:
    """One 4-element group per thread, capped at the blocks resident on the device (grid-stride
    beyond that), so no block waits for a second wave."""
    return max(1, min(math.ceil(n / (4 * ADAMW_THREADS)), max_grid))


def launch_adamw(variant: int, param_ptr: int, param_dtype, grad_ptr: int, grad_dtype, master_ptr: int, m_ptr: int,
                 v_ptr: int, n: int, scalars: np.ndarray | None, stream: int = 0, *, scalars_ptr: int = 0,
                 device: int | None = None, max_blocks: int | None = None) -> None:
    """Queue one AdamW update of ``n`` elements on ``stream``: a :func:`launch_adamw_multi` of one tensor.

    ``variant``: ``trainstream.contract.VARIANT_TORCH_CUDA`` or ``VARIANT_OPTAX_CUDA``. ``param_ptr``: the weights in
    GPU memory (``param_dtype`` float32/float16/bfloat16), updated in place. ``grad_ptr``: the gradient in GPU memory
    (any of the three dtypes). ``master_ptr``: fp32 master weights, required for fp16/bf16 weights, ``0`` for fp32
    ones. ``m_ptr``, ``v_ptr``: fp32 moments. State pointers are device pointers to mapped pinned host memory
    (:func:`alloc_mapped`) or GPU memory (:func:`alloc_device`); any element alignment works, 16-byte-aligned state
    takes the vector path. ``scalars``: :func:`trainstream.contract.step_scalars`' vector, by value (``S_CLIP`` 1.0
    when the framework has clipped or unscaled the gradient in place); or ``scalars_ptr``, a device pointer to those
    ``N_SCALARS`` float32 (``scalars`` may then be ``None``), e.g. computed inside an XLA program. ``max_blocks``: a
    cap on the grid (the bits do not depend on it), e.g. to leave multiprocessors to a backward running at the same
    time.
    """
    if not scalars_ptr and scalars is None:
        raise ValueError("pass the scalar vector (scalars) or a device pointer to it (scalars_ptr)")
    s = _check_ptr("scalars_ptr", scalars_ptr, 4) if scalars_ptr else scalars
    _launch_adamw_items(variant, param_dtype, grad_dtype, [(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, s)],
                        stream, device, max_blocks, named=False)


def launch_adamw_multi(variant: int, param_dtype, grad_dtype,
                       items: Iterable[tuple[int, int, int, int, int, int, np.ndarray | int]], stream: int = 0, *,
                       device: int | None = None, max_blocks: int | None = None) -> int:
    """Queue the AdamW updates of up to :data:`MULTI_MAX` tensors of one dtype pair in one launch (a driver call
    costs about 50 us on the H200, 200 us while the host workers hold the GIL).

    ``items``: ``(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, scalars)`` per tensor, as :func:`launch_adamw`'s
    arguments; ``scalars``: the float32 vector (by value) or an ``int``, a device pointer to it. Each tensor gets the
    blocks of its size (:func:`_grid_for`, also capped at ``max_blocks``) and grid-strides over them. Every argument
    is checked before anything is launched; tensors of 0 elements are then skipped. Returns the tensors launched.
    """
    return _launch_adamw_items(variant, param_dtype, grad_dtype, items, stream, device, max_blocks, named=True)


def launch_adamw_u_multi(variant: int, grad_dtype,
                         items: Iterable[tuple[int, int, int, int, int, int, np.ndarray | int]], stream: int = 0, *,
                         device: int | None = None) -> int:
    """:func:`launch_adamw_multi` of optax on float32 weights (read only) that writes the contract's ``u`` (the JAX
    adapter's ``update``: its program applies the learning rate). ``variant``: one of :data:`U_VARIANTS`. ``items``:
    ``(param_ptr, grad_ptr, u_ptr, m_ptr, v_ptr, n, scalars)``, ``u_ptr`` a float32 output in GPU memory."""
    return _launch_adamw_items(variant, "float32", grad_dtype, items, stream, device, None, named=True, emit_u=True)


def _launch_adamw_items(variant, param_dtype, grad_dtype, items, stream, device, max_blocks, *,
                        named: bool, emit_u: bool = False) -> int:
    """The one launcher (``named``: messages name the item, ``items[k].``; ``emit_u``: the kernels that
    write ``u`` into each item's third pointer). Null pointers pass only in an empty item."""
    kernel_name = (adamw_u_kernel_name(variant, grad_dtype) if emit_u  # checks the variant, then the dtypes
                   else adamw_kernel_name(variant, param_dtype, grad_dtype))
    pd, gd = _dtype_name(param_dtype), _dtype_name(grad_dtype)
    items = list(items)
    if len(items) > MULTI_MAX:
        raise ValueError(f"launch_adamw_multi takes at most {MULTI_MAX} tensors, got {len(items)}")
    if max_blocks is not None and (isinstance(max_blocks, bool) or int(max_blocks) != max_blocks or max_blocks < 1):
        raise ValueError(f"max_blocks must be an int >= 1 or None, got {max_blocks!r}")
    checked = []
    for k, item in enumerate(items):
        pre, dot = (f"items[{k}]: ", f"items[{k}].") if named else ("", "")
        if len(item) != 7:
            raise ValueError(f"{pre}expected (param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, scalars)")
        param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, scalars = item
        n = int(n)
        if n < 0:
            raise ValueError(f"{pre}n must be >= 0, got {n}")
        empty = n == 0  # checked like the others, then skipped; its pointers may be null
        if emit_u:  # the u output takes the master's place (float32 weights have none)
            master_ptr = _check_ptr(f"{dot}u_ptr", master_ptr, 4, allow_null=empty)
        param_ptr = _check_ptr(f"{dot}param_ptr", param_ptr, C.ITEMSIZE[pd], allow_null=empty)
        grad_ptr = _check_ptr(f"{dot}grad_ptr", grad_ptr, C.ITEMSIZE[gd], allow_null=empty)
        m_ptr = _check_ptr(f"{dot}m_ptr", m_ptr, 4, allow_null=empty)
        v_ptr = _check_ptr(f"{dot}v_ptr", v_ptr, 4, allow_null=empty)
        if pd != "float32":
            master_ptr = _check_ptr(f"{dot}master_ptr (required for {pd} weights)", master_ptr, 4, allow_null=empty)
        elif master_ptr and not emit_u:
            raise ValueError(f"{pre}fp32 weights are their own master: pass master_ptr=0")
        if isinstance(scalars, (int, np.integer)):
            sc = _check_ptr(f"{dot}scalars_ptr", scalars, 4)
        else:
            sc = np.ascontiguousarray(scalars, dtype=np.float32)
            if sc.shape != (C.N_SCALARS,):
                raise ValueError(f"{pre}scalars must have shape ({C.N_SCALARS},), got {sc.shape}")
        if not empty:
            checked.append((param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, sc))
    if not checked:
        return 0
    dev = _device_index(device)
    kernel = _kernel(dev, kernel_name)
    cap = kernel.max_grid if max_blocks is None else min(kernel.max_grid, int(max_blocks))
    batch = _MultiBatch()
    start = 0
    for k, (param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, sc) in enumerate(checked):
        it = batch.items[k]
        it.param, it.grad, it.master, it.m, it.v = param_ptr, grad_ptr, master_ptr or None, m_ptr, v_ptr
        it.n, it.nblocks, it.block_start = n, _grid_for(n, cap), start
        start += it.nblocks
        if isinstance(sc, int):
            it.scalars_dev = sc
        else:
            ctypes.memmove(ctypes.addressof(it.scalars), sc.ctypes.data, sc.nbytes)
    for k in range(len(checked), MULTI_MAX):
        batch.items[k].block_start = _UNUSED_BLOCK
    _launch(dev, kernel, start, ADAMW_THREADS, [batch], stream)
    return len(checked)


# -- mapped pinned host memory ---------------------------------------------------------------
def alloc_mapped(nbytes: int, device: int | None = None) -> tuple[int, int, Callable[[], None]]:
    """:meth:`trainstream._cuda.Context.alloc_mapped` as ``(host_ptr, dev_ptr, free)``; ``free()`` releases it
    (idempotent; also when the last reference to ``free`` goes)."""
    buf = _cuda.context(_device_index(device)).alloc_mapped(nbytes)
    return buf.host_ptr, buf.dev_ptr, buf.free


def alloc_device(nbytes: int, device: int | None = None) -> _cuda.DeviceMemory:
    """:meth:`trainstream._cuda.Context.alloc_device` (the kernels take its ``dev_ptr``)."""
    return _cuda.context(_device_index(device)).alloc_device(nbytes)


def host_view(host_ptr: int, count: int, dtype=np.float32) -> np.ndarray:
    """A NumPy view (no copy) of ``count`` elements at a host address; it does not keep the
    memory alive (drop it before calling :func:`alloc_mapped`'s ``free``)."""
    dtype = np.dtype(dtype)
    count = int(count)
    if count == 0:
        return np.empty(0, dtype)
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(host_ptr))
    return np.frombuffer(buf, dtype=dtype, count=count)
