"""CuPy loader and launcher of the ``gpu`` mode kernels (the checkout's ``kernels/*.cu``, installed as the package
data ``trainstream/kernels/``: the cuda platform's arithmetic of each :mod:`trainstream.contract` convention,
torch/cuda and optax/cuda, and of torch's CUDA recipes, :mod:`trainstream._device_recipes`; the cpu platforms' is the
host kernels'): compiled once per device, launched
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
import threading
from typing import Callable, Iterable, NamedTuple

import numpy as np

from . import _cuda
from . import _device_recipes as R
from . import contract as C
from ._device_sources import (ADAMW_SOURCE, ADAMW_THREADS, KERNEL_SOURCES, MULTI_MAX, SCALAR_SETS, _UNUSED_BLOCK,
                              _VARIANT_NAMES, KernelItem, _MultiBatch, _MultiItem, _Scalars,  # noqa: F401
                              check_kernel_constants, kernel_source, program_source)

__all__ = ["ADAMW_SOURCE", "KERNEL_SOURCES", "kernel_source", "program_source", "ADAMW_THREADS", "DTYPES",
           "adamw_kernel_name", "check_kernel_constants", "compile_kernels", "launch_adamw", "launch_adamw_multi",
           "launch_adamw_u_multi", "U_VARIANTS", "adamw_u_kernel_name", "MULTI_MAX", "SCALAR_SETS", "KernelItem",
           "launch_items", "alloc_mapped", "alloc_device", "host_view", "check_stream", "set_sync_launches", "OPTAX_STATES",
           "kernel_names", "update_dtype"]

COMPILE_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

DTYPES = ("float32", "float16", "bfloat16")
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_DTYPE_ALIASES = {**{d: d for d in DTYPES}, "float": "float32", "fp32": "float32", "f32": "float32",
                  "half": "float16", "fp16": "float16", "f16": "float16", "bf16": "bfloat16"}
_HOST_ONLY = {C.VARIANT_TORCH_CPU: "torch/cpu", C.VARIANT_OPTAX_CPU: "optax/cpu"}


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


#: optax/cuda's kernels with optax's own state (no master): ``(weights, mu, nu)`` dtypes (fp16/bf16 leaves' state in
#: their dtype, bf16 leaves with ``mu_dtype=float32``, float32 leaves with ``mu_dtype=bfloat16``).
OPTAX_STATES = (("float16", "float16", "float16"), ("bfloat16", "bfloat16", "bfloat16"),
                ("bfloat16", "float32", "bfloat16"), ("float32", "bfloat16", "float32"))
_F32_STATE = ("float32", "float32")


def _state_suffix(variant: int, param_dtype: str, state) -> str:
    """``""`` for float32 state (``state`` None or float32 mu and nu), else ``_s<mu>_<nu>`` of an
    :data:`OPTAX_STATES` kernel (``ValueError`` for any other)."""
    state = _F32_STATE if state is None else tuple(_dtype_name(d) for d in state)
    if state == _F32_STATE:
        return ""
    if variant != C.VARIANT_OPTAX_CUDA or (param_dtype, *state) not in OPTAX_STATES:
        raise ValueError(f"no kernel keeps mu/nu in {state[0]}/{state[1]} for {param_dtype} weights in variant "
                         f"{variant!r}; optax/cuda's are {OPTAX_STATES} (weights, mu, nu)")
    return f"_s{_SUFFIX[state[0]]}_{_SUFFIX[state[1]]}"


def adamw_kernel_name(variant: int, param_dtype, grad_dtype, state=None) -> str:
    """The ``extern "C"`` name of the AdamW kernel for a variant (:data:`trainstream.contract.VARIANT_TORCH_CUDA` or
    ``VARIANT_OPTAX_CUDA``), two dtypes and the state's (``(mu, nu)``; None: float32, with an fp32 master for
    fp16/bf16 weights)."""
    _check_variant(variant, _VARIANT_NAMES)
    pd = _dtype_name(param_dtype)
    return (f"adamw_{_VARIANT_NAMES[variant]}_{_SUFFIX[pd]}_{_SUFFIX[_dtype_name(grad_dtype)]}"
            + _state_suffix(variant, pd, state))


#: The variants with a kernel that writes optax's ``u`` (:func:`launch_adamw_u_multi`).
U_VARIANTS = (C.VARIANT_OPTAX_CUDA,)


def adamw_u_kernel_name(variant: int, grad_dtype, param_dtype="float32", state=None) -> str:
    """The ``extern "C"`` name of the kernel that writes optax's ``u``: float32 weights with float32 state, or the
    weights and state of an :data:`OPTAX_STATES` kernel."""
    if variant not in U_VARIANTS and variant in _VARIANT_NAMES:
        raise ValueError(f"variant {variant!r} has no kernel that writes u; expected one of {U_VARIANTS}")
    _check_variant(variant, U_VARIANTS)
    pd, suffix = _dtype_name(param_dtype), _state_suffix(variant, _dtype_name(param_dtype), state)
    if pd != "float32" and not suffix:
        raise ValueError(f"no kernel writes u of {pd} weights with an fp32 master (the master is the weights)")
    return f"adamw_u_{_VARIANT_NAMES[variant]}_{_SUFFIX[pd]}_{_SUFFIX[_dtype_name(grad_dtype)]}{suffix}"


def update_dtype(param_dtype, state=None) -> str:
    """The dtype of the ``u`` that :func:`adamw_u_kernel_name`'s kernel writes: the weights' where mu and nu are in
    it too (optax's update of fp16/bf16 state), else float32."""
    pd = _dtype_name(param_dtype)
    return pd if state is not None and tuple(_dtype_name(d) for d in state) == (pd, pd) else "float32"


def kernel_names() -> list[str]:
    """Every kernel the loader loads: the conventions' (and optax/cuda's with :data:`OPTAX_STATES`) and the
    recipes'."""
    ox = C.VARIANT_OPTAX_CUDA
    return ([adamw_kernel_name(v, p, g) for v in _VARIANT_NAMES for p in DTYPES for g in DTYPES]
            + [adamw_u_kernel_name(v, g) for v in U_VARIANTS for g in DTYPES]
            + [name(ox, p, g, (mu, nu)) for p, mu, nu in OPTAX_STATES for g in DTYPES
               for name in (adamw_kernel_name, lambda v, p, g, st: adamw_u_kernel_name(v, g, p, st))]
            + recipe_kernel_names())


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
                _modules["adamw"] = cp.RawModule(code=program_source(), options=COMPILE_OPTIONS)
            names = kernel_names()
            table = {}
            with cp.cuda.Device(dev):
                sm_count = multiprocessor_count(dev)
                for name in names:
                    function = _modules["adamw"].get_function(name).kernel  # compiles once
                    per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, ADAMW_THREADS, 0)
                    table[name] = _Kernel(name, function, int(function.ptr), max(1, per_sm) * sm_count)
            _kernels[dev] = table
    return {k: v.max_grid for k, v in _kernels[dev].items()}


def recipe_kernel_names() -> list[str]:
    """The kernels of torch's CUDA recipes (:func:`trainstream._device_recipes.recipe_kernel_name`): op-by-op and
    fused, for each weight dtype with its own or fp32 state, and each gradient dtype."""
    return [f"adamw_torch_{impl}_{_SUFFIX[p]}_{_SUFFIX[g]}_{_SUFFIX[st]}" for impl in ("ops", "fused")
            for p in DTYPES for st in dict.fromkeys((p, "float32")) for g in DTYPES]


def program_function(name: str, device: int | None = None):
    """A ``cupy.RawKernel``-like function of the compiled program (e.g. the GPU tests' diagnostic kernels)."""
    compile_kernels(device)
    return _modules["adamw"].get_function(name)


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
                       device: int | None = None, max_blocks: int | None = None, state=None) -> int:
    """Queue the AdamW updates of up to :data:`MULTI_MAX` tensors of one dtype pair in one launch (a driver call
    costs about 50 us on the H200, 200 us while the host workers hold the GIL).

    ``items``: ``(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, n, scalars)`` per tensor, as :func:`launch_adamw`'s
    arguments; ``scalars``: the float32 vector (by value) or an ``int``, a device pointer to it. Each tensor gets the
    blocks of its size (:func:`_grid_for`, also capped at ``max_blocks``) and grid-strides over them. Every argument
    is checked before anything is launched; tensors of 0 elements are then skipped. Returns the tensors launched.
    ``state``: ``(mu, nu)`` dtypes of an :data:`OPTAX_STATES` kernel (no master: ``master_ptr`` 0); None: float32.
    """
    return _launch_adamw_items(variant, param_dtype, grad_dtype, items, stream, device, max_blocks, named=True,
                               state=state)


def launch_adamw_u_multi(variant: int, grad_dtype,
                         items: Iterable[tuple[int, int, int, int, int, int, np.ndarray | int]], stream: int = 0, *,
                         device: int | None = None, param_dtype="float32", state=None) -> int:
    """:func:`launch_adamw_multi` of optax on weights read only that writes the contract's ``u`` (the JAX adapter's
    ``update``: its program applies the learning rate): float32 weights and state, or ``param_dtype`` weights with
    ``state`` (``(mu, nu)``, an :data:`OPTAX_STATES` kernel). ``variant``: one of :data:`U_VARIANTS`. ``items``:
    ``(param_ptr, grad_ptr, u_ptr, m_ptr, v_ptr, n, scalars)``, ``u_ptr`` an output in GPU memory of
    :func:`update_dtype`."""
    return _launch_adamw_items(variant, param_dtype, grad_dtype, items, stream, device, None, named=True, emit_u=True,
                               state=state)


def _launch_adamw_items(variant, param_dtype, grad_dtype, items, stream, device, max_blocks, *,
                        named: bool, emit_u: bool = False, state=None) -> int:
    """The conventions' launcher (``named``: messages name the item, ``items[k].``; ``emit_u``: the kernels that
    write ``u`` into each item's third pointer; ``state``: mu's and nu's dtypes, None: float32). Null pointers pass
    only in an empty item."""
    kernel_name = (adamw_u_kernel_name(variant, grad_dtype, param_dtype, state) if emit_u  # checks the variant, then
                   else adamw_kernel_name(variant, param_dtype, grad_dtype, state))        # the dtypes
    pd, gd = _dtype_name(param_dtype), _dtype_name(grad_dtype)
    md, vd = _F32_STATE if state is None else (_dtype_name(state[0]), _dtype_name(state[1]))
    own_state = (md, vd) != _F32_STATE  # optax's own state: no master
    flags = R.F_DECAY if variant == C.VARIANT_TORCH_CUDA else 0  # torch/cuda: p * f(1 - lr*wd), always
    items = list(items)
    if len(items) > MULTI_MAX:
        raise ValueError(f"launch_adamw_multi takes at most {MULTI_MAX} tensors, got {len(items)}")
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
        if emit_u:  # the u output takes the master's place (float32 weights and optax's own state have none)
            master_ptr = _check_ptr(f"{dot}u_ptr", master_ptr, C.ITEMSIZE[update_dtype(pd, (md, vd))],
                                    allow_null=empty)
        param_ptr = _check_ptr(f"{dot}param_ptr", param_ptr, C.ITEMSIZE[pd], allow_null=empty)
        grad_ptr = _check_ptr(f"{dot}grad_ptr", grad_ptr, C.ITEMSIZE[gd], allow_null=empty)
        m_ptr = _check_ptr(f"{dot}m_ptr", m_ptr, C.ITEMSIZE[md], allow_null=empty)
        v_ptr = _check_ptr(f"{dot}v_ptr", v_ptr, C.ITEMSIZE[vd], allow_null=empty)
        if own_state and not emit_u:
            if master_ptr:
                raise ValueError(f"{pre}{pd} weights with {md}/{vd} state have no master: pass master_ptr=0")
        elif pd != "float32" and not emit_u:
            master_ptr = _check_ptr(f"{dot}master_ptr (required for {pd} weights)", master_ptr, 4, allow_null=empty)
        elif master_ptr and not emit_u:
            raise ValueError(f"{pre}fp32 weights are their own master: pass master_ptr=0")
        sc = _scalar_vector(scalars, pre, dot)
        if not empty:
            checked.append(KernelItem(param_ptr, grad_ptr, int(master_ptr or 0), m_ptr, v_ptr, 0, n, sc, 0, flags))
    return launch_items(kernel_name, checked, stream, device, max_blocks)


def _scalar_vector(scalars, pre: str = "", dot: str = "") -> np.ndarray | int:
    """A scalar vector as the kernels take it: an ``int`` (a device pointer: the kernels read the optax convention's
    slots there), or float32 of the contract's ``N_SCALARS``."""
    if isinstance(scalars, (int, np.integer)):
        return _check_ptr(f"{dot}scalars_ptr", scalars, 4)
    sc = np.ascontiguousarray(scalars, dtype=np.float32)
    if sc.shape != (C.N_SCALARS,):
        raise ValueError(f"{pre}scalars must have shape ({C.N_SCALARS},), got {sc.shape}")
    return sc


def launch_items(kernel_name: str, items: list[KernelItem], stream: int = 0, device: int | None = None,
                 max_blocks: int | None = None) -> int:
    """Launch kernel ``kernel_name`` over checked, non-empty :class:`KernelItem`\\ s, in launches of up to
    :data:`MULTI_MAX` tensors and :data:`SCALAR_SETS` distinct scalar vectors (in order, on ``stream``). Each tensor
    gets the blocks of its size (:func:`_grid_for`, also capped at ``max_blocks``) and grid-strides over them.
    Returns the tensors launched."""
    if max_blocks is not None and (isinstance(max_blocks, bool) or int(max_blocks) != max_blocks or max_blocks < 1):
        raise ValueError(f"max_blocks must be an int >= 1 or None, got {max_blocks!r}")
    if not items:
        return 0
    dev = _device_index(device)
    kernel = _kernel(dev, kernel_name)
    cap = kernel.max_grid if max_blocks is None else min(kernel.max_grid, int(max_blocks))
    batch, sets, count, start = _MultiBatch(), {}, 0, 0

    def flush():
        for k in range(count, MULTI_MAX):
            batch.items[k].block_start = _UNUSED_BLOCK
        _launch(dev, kernel, start, ADAMW_THREADS, [batch], stream)

    for it in items:
        key = None if isinstance(it.scalars, int) else it.scalars.tobytes()
        if count == MULTI_MAX or (key is not None and key not in sets and len(sets) == SCALAR_SETS):
            flush()
            batch, sets, count, start = _MultiBatch(), {}, 0, 0
        t = batch.items[count]
        t.param, t.grad, t.master, t.m, t.v = it.param, it.grad, it.master or None, it.m, it.v
        t.vmax, t.n, t.base, t.flags = it.vmax or None, it.n, it.base, it.flags
        t.nblocks, t.block_start = _grid_for(it.n, cap), start
        if key is None:
            t.scalars_dev = it.scalars
        else:
            if key not in sets:
                sets[key] = len(sets)
                ctypes.memmove(ctypes.addressof(batch.sets[sets[key]]), it.scalars.ctypes.data, it.scalars.nbytes)
            t.sidx = sets[key]
        start += t.nblocks
        count += 1
    flush()
    return len(items)


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
