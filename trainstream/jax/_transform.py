"""JAX adapter: ``offload_adamw``, an optax-style AdamW whose state lives in host memory.

No arithmetic lives here: the update is the engine's (``trainstream.core._engine``), whose
arithmetic is the contract's (``trainstream.contract``). This module computes, inside
the user's jitted program, the per-step inputs that only XLA can reproduce (bias
corrections through glibc ``powf``, the learning-rate schedule, optax's global norm),
hands them with the gradients to the engine through an XLA typed-FFI call whose handler
is Python (``trainstream.jax._xla_ffi``), and returns the new parameters.

Data path (``mode="cpu"``, JAX on the CPU backend: everything is host memory)::

    jitted step:  count' = safe_increment(count)
                  scalars = [-lr, 1 - b1**count', 1 - b2**count', clip divisor, clip factor]
                  count', new_params = ffi("trainstream_adamw_update", handle=..)(
                      count', scalars, *grads, *params)   # params aliased -> outputs
    handler:      gradients copied into the engine's staging buffers, the engine updates
                  its fp32 master and moments (Numba kernels, worker threads), the new
                  weights (master, or its fp16/bf16 rounding) are written into the outputs.

The handler reads XLA's buffers through zero-copy NumPy views: the kernels read the
gradients in place, and the one copy per element is that of the new weights from the
engine's fp32 master (or its fp16/bf16 rounding) into XLA's output buffer (the master
must outlive the call; XLA's buffers do not). The state threads the calls:
the new ``count`` is an *output* of the FFI call (aliased to its input), so the next
update consumes it and XLA can neither reorder nor drop a step whose state is used; the
call is marked side-effecting in HLO (no CSE, no DCE by XLA) without leaving jit's fast
dispatch path (:func:`~trainstream.jax._xla_ffi.stateful_ffi_call`). Per-step values
travel as a float32[5] operand, so the program compiles once. The engine's handle is a
static part of the state (:class:`EngineHandle`), an attribute of the call.

On a CUDA GPU (XLA:GPU; :mod:`trainstream.jax._gpu`) the same call runs a
second handler, which works on XLA's stream (``XLA_FFI_Stream_Get``):

* ``mode="gpu"``: the scalars are a float32[leaves, 12] matrix computed in the program;
  the handler launches one zero-copy kernel per leaf on XLA's stream (state in mapped
  host memory, weights updated in place in the aliased output). Nothing waits.
* ``mode="cpu"``: the handler reads the 5 scalars and the count back (a wait for the
  program up to this call: the gradients are then ready), copies each gradient into
  pinned staging on XLA's stream, the workers update each leaf as its copy lands and
  queue its upload on XLA's stream; the handler returns when the host work is done.

Eagerly (outside ``jax.jit``) on the CPU the same scalars come from one small jitted
function and the engine reads the gradients through zero-copy NumPy views of the JAX
buffers; the new weights are written into fresh 64-byte-aligned host buffers that
``jax.device_put`` adopts without a copy. Eagerly on a GPU the FFI program itself is
dispatched through a cached ``jax.jit`` (device arrays go in as they are).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import threading
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import contract as C
from .. import _hostmem
from ..core import Engine
from . import _xla_ffi as xf

__all__ = [
    "EngineHandle",
    "JaxCpuBackend",
    "OffloadAdamW",
    "OffloadAdamWState",
    "close",
    "load_state_dict",
    "offload_adamw",
    "state_dict",
    "stats",
]

_TARGET = "trainstream_adamw_update"
_N_DYN = 5  # the in-graph scalars: -lr, d1, d2, clip divisor, clip factor
_I32_MAX = np.iinfo(np.int32).max
_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16"}


# -- the engine's backend: host memory only (JAX on the CPU) ------------------------------------


def _aligned_empty(shape, dtype, align: int = 64, *, huge: bool = False) -> np.ndarray:
    """An uninitialised host array whose data is ``align``-byte aligned (XLA:CPU adopts
    such buffers in ``device_put`` without a copy); with ``huge``, from
    :func:`trainstream._hostmem.empty` (2 MiB pages where it spans one)."""
    n = int(np.prod(shape, dtype=np.int64))
    if huge:
        return _hostmem.empty(n, dtype, align=align).reshape(shape)
    return _hostmem.aligned_empty(n, dtype, align).reshape(shape)


class _HostBuffer:
    __slots__ = ("array", "handle", "pinned")

    def __init__(self, array: np.ndarray):
        self.array = array
        self.handle = array
        self.pinned = False


class _Leaf:
    """The engine's ``param`` of one leaf: where its new weights go this step."""

    __slots__ = ("index", "init", "out", "out_ptr")

    def __init__(self, index: int, init: np.ndarray):
        self.index = index
        self.init = init  # float32, flat: the weights at registration
        self.out: np.ndarray | None = None  # flat view of this step's output (bits for 16-bit)
        self.out_ptr: int | None = None  # CUDA: device address of this step's output


class JaxCpuBackend:
    """The engine :class:`~trainstream.core._engine.Backend` for JAX CPU arrays.

    All memory is host memory: copies are synchronous NumPy copies, there are no events
    (every method that returns one returns None) and nothing is pinned.

    Gradients are not copied: ``copy_to_host`` points the staging buffer at the caller's
    (XLA's) gradient array for the duration of one update, and :meth:`release_grads`
    points it back once the engine has synchronised (the caller's buffers are only valid
    during the FFI call or the eager update).
    """

    def __init__(self) -> None:
        self._lent: list = []  # (staging buffer, its own array) while lent a gradient

    def release_grads(self) -> None:
        for buf, own in self._lent:
            buf.array = own
        self._lent.clear()

    def host_empty(self, numel: int, dtype: str, *, pinned: bool, what: str) -> _HostBuffer:
        np_dtype = np.float32 if dtype == "float32" else np.uint16
        try:
            return _HostBuffer(_aligned_empty((numel,), np_dtype, huge=True))  # 2 MiB pages
        except (MemoryError, OSError) as exc:  # OSError: mmap (trainstream._hostmem)
            nbytes = numel * np.dtype(np_dtype).itemsize
            raise MemoryError(f"TrainStream could not allocate {nbytes} bytes of host memory for {what}") from exc

    def param_to_host_f32(self, param: _Leaf, out: np.ndarray) -> None:
        out[:] = param.init

    def record_compute(self, param: Any) -> None:
        return None

    def copy_to_host(self, dst: _HostBuffer, src: np.ndarray, after: Any) -> None:
        if src.dtype == dst.array.dtype and src.shape == dst.array.shape and src.flags.c_contiguous:
            self._lent.append((dst, dst.array))
            dst.array = src  # read in place until release_grads
        else:
            np.copyto(dst.array, src)
        return None

    def copy_to_device(self, dst: _Leaf, src: _HostBuffer, after: Any) -> None:
        if dst.out is not None:
            np.copyto(dst.out, src.array)
        return None

    def wait_on_compute(self, event: Any, param: Any) -> None:
        pass

    def all_reduce_sum(self, value: float) -> float:
        return value


# -- configuration ---------------------------------------------------------------------------


class _Config(NamedTuple):
    learning_rate: Any  # float or schedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    max_grad_norm: float | None
    mask: Any
    xla_fused_grads: Any
    mode: str
    convention: str
    threads: int | None
    chunk_elems: int
    worker_nice: int = 5


@jax.tree_util.register_static
class EngineHandle(int):
    """The key of an engine in this process's registry: a *static* pytree node.

    Static (part of the tree structure, not an array), so that a jitted step knows its
    engine at trace time: the FFI call carries it as an attribute, and on a GPU the
    handler never has to read it back from device memory.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"EngineHandle({int(self)})"


class OffloadAdamWState(NamedTuple):
    """The optax state of :func:`offload_adamw`.

    ``handle``: :class:`EngineHandle`, the key of the engine (host state) in this
    process's registry (static: no array). ``count``: int32 scalar, the number of updates
    so far (optax's ``count``). The moments and master weights live in the engine:
    export them with :func:`state_dict`.
    """

    handle: Any
    count: Any


def _spec_of(leaves, treedef) -> tuple:
    return (str(treedef), tuple((tuple(np.shape(x)), np.dtype(x.dtype).name) for x in leaves))


def _fingerprint(spec: tuple) -> str:
    return hashlib.sha1(repr(spec).encode()).hexdigest()[:16]


# -- the registry of live engines ----------------------------------------------------------------


class _Instance:
    """One ``init``: an engine, the structure it was built for, and per-leaf constants.

    ``platform``: where the parameters live, ``"cpu"`` (XLA:CPU, host buffers) or
    ``"cuda"`` (XLA:GPU, device ``device``). The engine is the host engine
    (:class:`~trainstream.core._engine.Engine`): host placement in ``mode="cpu"``, device
    placement (zero-copy kernels) in ``mode="gpu"``.
    """

    def __init__(self, handle: int, cfg: _Config, leaves, treedef, decay: list[bool], fused: list[bool],
                 platform: str = "cpu", device: int = 0):
        self.handle = handle
        self.cfg = cfg
        self.treedef = treedef
        self.platform = platform
        self.device = device
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [_DTYPES[np.dtype(x.dtype)] for x in leaves]
        self.spec = _spec_of(leaves, treedef)
        self.fingerprint = _fingerprint(self.spec)
        self.lock = threading.Lock()
        n = len(leaves)
        self.gpu_mode = cfg.mode == "gpu"
        self.stale: str | None = None  # gpu mode: an old state was used (sticky)
        if self.gpu_mode:
            from ._jax_cuda import JaxGpuBackend  # noqa: PLC0415

            self.backend = JaxGpuBackend(device)
            self.engine = Engine(self.backend, placement="gpu", convention=cfg.convention)
            self.count_check = self.backend.count_checker()
        else:
            if platform == "cuda":
                from ._jax_cuda import JaxCudaHostBackend  # noqa: PLC0415

                self.backend = JaxCudaHostBackend(device)
            else:
                self.backend = JaxCpuBackend()
            sqrt_mode = _torch_sqrt_mode() if cfg.convention == "torch" and platform == "cpu" else 0
            self.engine = Engine(
                self.backend,
                placement="cpu",
                threads=cfg.threads,
                chunk_elems=cfg.chunk_elems,
                convention=cfg.convention,
                tc_code=sqrt_mode,
                worker_nice=cfg.worker_nice,
            )
        self.leaves: list[_Leaf] = []
        base_lr = 0.0 if callable(cfg.learning_rate) else float(cfg.learning_rate)
        self.hps = []
        templ = np.zeros((n, C.N_SCALARS), np.float32)
        try:
            for i, x in enumerate(leaves):
                leaf = _Leaf(i, np.asarray(x).astype(np.float32).reshape(-1))
                numel = leaf.init.size
                if self.gpu_mode:
                    sid = self.engine.add_param(leaf, numel, self.dtypes[i], "cuda")
                else:
                    sid = self.engine.add_param(leaf, numel, self.dtypes[i], platform)
                assert sid == i
                leaf.init = None  # the engine's master holds it now (gpu mode, fp32: the params)
                self.leaves.append(leaf)
                wd = cfg.weight_decay if decay[i] else 0.0
                hp = C.AdamWHyperParams(base_lr, cfg.b1, cfg.b2, cfg.eps, wd)
                self.hps.append(hp)
                if cfg.convention == "optax":
                    if platform == "cpu":
                        code = C.optax_cpu_code(n, numel, cfg.max_grad_norm, fused_grad=fused[i],
                                                fma=_xla_cpu_fma())
                    else:  # optax/cuda reads only the clip bit
                        code = C.OX_CLIP if cfg.max_grad_norm is not None else 0
                    templ[i] = C.optax_step_scalars(hp, 1.0, 1.0, code=code, decay=decay[i] and wd != 0.0)
        except BaseException:
            self.engine.close()
            raise
        self.templ = templ
        self.clip_rows = (templ[:, C.S_OX_CODE].astype(np.int64) & C.OX_CLIP) != 0

    @property
    def n(self) -> int:
        return len(self.leaves)

    # -- one update (the FFI handler and the eager path both come here) --------------------

    def check_buffers(self, grads, outs) -> None:
        if len(grads) != self.n or len(outs) != self.n:
            raise ValueError(
                f"TrainStream offload_adamw: the engine holds {self.n} leaves, the call passed "
                f"{len(grads)} gradients and {len(outs)} parameters"
            )
        for i, (g, o) in enumerate(zip(grads, outs)):
            for what, a in (("gradient", g), ("parameter", o)):
                if tuple(a.shape) != self.shapes[i] or _DTYPES.get(np.dtype(a.dtype)) != self.dtypes[i]:
                    raise ValueError(
                        f"TrainStream offload_adamw: {what} leaf {i} has shape {tuple(a.shape)} and "
                        f"dtype {a.dtype}, the optimizer state was created for {self.shapes[i]} "
                        f"{self.dtypes[i]} (pytree changed since init?)"
                    )

    def _check_count(self, count_inc: int, done: int | None = None) -> None:
        if done is None:
            done = self.engine.get_step(0) if self.n else 0
        if count_inc != done + 1 and not (count_inc == _I32_MAX and done >= _I32_MAX - 1):
            raise RuntimeError(
                f"TrainStream offload_adamw: the optimizer state passed in has count "
                f"{count_inc - 1} but engine {self.handle} has made {done} updates. The moments "
                "live in host memory, so only the state returned by the previous update is "
                "valid (an old state cannot be reused; restore a checkpoint with "
                "load_state_dict instead)"
            )

    def _host_step(self, dyn: np.ndarray) -> None:
        """Queue the update of every leaf whose gradient was offloaded (host engine)."""
        eng = self.engine
        if self.cfg.convention == "optax":
            s = self.templ.copy()
            s[:, C.S_NEG_LR] = dyn[0]
            s[:, C.S_BC1] = dyn[1]
            s[:, C.S_BC2_OPTAX] = dyn[2]
            s[self.clip_rows, C.S_CLIP_DIV] = dyn[3]
            s[self.clip_rows, C.S_CLIP] = dyn[4]
            eng.step(list(enumerate(self.hps)), scalars_fn=lambda sid, step: s[sid])
        else:
            hps = self.hps
            if callable(self.cfg.learning_rate):
                lr = -float(np.float32(dyn[0]))
                hps = [hp._replace(lr=lr) for hp in hps]
            eng.step(list(enumerate(hps)), max_grad_norm=self.cfg.max_grad_norm)

    def run(self, count_inc: int, dyn: np.ndarray, grads: list[np.ndarray], outs: list[np.ndarray]) -> None:
        """Update every leaf with ``grads``; write the new weights into ``outs`` (host buffers).

        ``count_inc``: the step number after increment; ``dyn``: the float32[5] in-graph
        scalars. ``grads``/``outs``: NumPy arrays of the leaves' shapes and dtypes.
        """
        eng = self.engine
        with self.lock:
            if eng.closed:
                raise RuntimeError(f"TrainStream offload_adamw: engine {self.handle} is closed")
            self.check_buffers(grads, outs)
            self._check_count(count_inc)
            ok = False
            try:
                for i, leaf in enumerate(self.leaves):
                    leaf.out = _flat_bits(outs[i])
                for i in range(self.n):
                    eng.offload_grad(i, _flat_bits(grads[i]), self.dtypes[i])
                self._host_step(dyn)
                eng.synchronize()
                ok = True
            finally:
                if not ok:  # forget gradients offloaded before the failure (they are lent)
                    try:
                        eng.discard_grads()
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
                for leaf in self.leaves:
                    leaf.out = None
                self.backend.release_grads()

    def run_cuda(self, stream: int, count: xf.Buffer, dyn: xf.Buffer, grads: list, outs: list) -> None:
        """The XLA:GPU handler's update: buffers are device buffers of this call.

        ``mode="gpu"``: one zero-copy kernel per leaf on ``stream``; ``dyn`` is the
        float32[n, N_SCALARS] scalar matrix computed in the program. ``mode="cpu"``:
        ``dyn`` (float32[5]) and ``count`` are read back (which waits for the program up
        to this call), each gradient is copied to pinned staging on ``stream``, the host
        engine updates as the copies land and uploads each leaf on ``stream``; returns
        once the host work is done (the uploads are queued before XLA's next work).
        """
        eng = self.engine
        with self.lock:
            if eng.closed:
                raise RuntimeError(f"TrainStream offload_adamw: engine {self.handle} is closed")
            self.check_buffers(grads, outs)
            if self.gpu_mode:
                if tuple(dyn.shape) != (self.n, C.N_SCALARS):
                    raise ValueError(f"scalar matrix of shape {dyn.shape}, expected {(self.n, C.N_SCALARS)}")
                # The count is on the device: reading it now would stall XLA's stream. It is
                # copied back asynchronously and checked at a later call (or state_dict /
                # close): an old state is reported one or more steps late, never ignored.
                self.check_counts(block=False)
                done = self.engine.get_step(0) if self.n else 0
                self.count_check.enqueue(count.data, done, stream)
                row = 4 * C.N_SCALARS
                eng.step_external(
                    stream,
                    [(i, outs[i].data, grads[i].data, self.dtypes[i], dyn.data + row * i) for i in range(self.n)],
                )
                return
            from ._jax_cuda import DeviceRef  # noqa: PLC0415

            be = self.backend
            be.stream = stream
            raw = be.read_small(dyn.data, 4 * _N_DYN)
            dyn_h = raw.view(np.float32)
            count_inc = int(be.read_small(count.data, 4).view(np.int32)[0])
            self._check_count(count_inc)
            ok = False
            try:
                for i, leaf in enumerate(self.leaves):
                    leaf.out_ptr = outs[i].data
                for i in range(self.n):
                    eng.offload_grad(i, DeviceRef(grads[i].data, grads[i].nbytes), self.dtypes[i])
                self._host_step(dyn_h)
                eng.wait_host()
                ok = True
            finally:
                if not ok:
                    try:
                        eng.discard_grads()
                    except Exception:  # noqa: BLE001
                        pass
                for leaf in self.leaves:
                    leaf.out_ptr = None

    def check_counts(self, block: bool) -> None:
        """``mode="gpu"``: check the counts copied back by earlier calls (see run_cuda).

        A mismatch is sticky: every later call raises it until ``load_state_dict``
        restores a consistent state (the update of the old state has already run).
        """
        if not self.gpu_mode:
            return
        if self.stale is not None:
            raise RuntimeError(self.stale)
        for count_inc, done in self.count_check.completed(block):
            try:
                self._check_count(count_inc, done)
            except RuntimeError as exc:
                self.stale = str(exc) + " (detected after that update ran: restore a checkpoint)"
                raise RuntimeError(self.stale) from None

    def synchronize_device(self, check: bool = True) -> None:
        """Before the host reads or writes the state: the device's queued work is done."""
        if self.platform == "cuda":
            from ._jax_cuda import device_synchronize  # noqa: PLC0415

            device_synchronize(self.device)
            if check:
                self.check_counts(block=True)


def _flat_bits(a: np.ndarray) -> np.ndarray:
    """A flat view of ``a`` as the engine's buffers hold it (uint16 bits for fp16/bf16)."""
    a = a.reshape(-1)
    return a if a.dtype == np.float32 else a.view(np.uint16)


_instances: dict[int, _Instance] = {}
_instances_lock = threading.Lock()
# Handles start at a random base per process: a state unpickled in another process then
# names no engine there (refused with a clear error) instead of someone else's engine.
_handles = itertools.count(1 + (int.from_bytes(os.urandom(4), "little") << 20))


def _instance(handle) -> _Instance:
    try:
        h = int(np.asarray(handle))
    except (TypeError, ValueError):
        raise TypeError(f"not a TrainStream offload_adamw state handle: {handle!r}") from None
    inst = _instances.get(h)
    if inst is None:
        raise KeyError(
            f"TrainStream offload_adamw: no engine with handle {h} in this process (the state "
            "was created in another process, or closed). Call tx.init(params) and restore a "
            "checkpoint with load_state_dict."
        )
    return inst


def _torch_sqrt_mode() -> int:
    """The contract's torch/cpu code (torch's sqrt path and lerp fusing, probed once)."""
    try:
        import torch  # noqa: F401, PLC0415 (even where the adapter was imported before)

        from ..torch._backend import torch_cpu_code  # noqa: PLC0415
    except ImportError:
        raise RuntimeError(
            "convention='torch' reproduces torch.optim.AdamW on the CPU, whose sqrt is MKL's "
            "and differs from CPU to CPU; TrainStream finds which one by probing torch.sqrt, "
            "so torch must be importable (pip install torch), or use convention='optax'"
        ) from None
    return torch_cpu_code()


_XLA_CPU_FMA: bool | None = None


def _xla_cpu_fma() -> bool:
    """Whether XLA:CPU contracts ``a*b + c`` into an FMA (its target ISA has FMA3; not with
    ``--xla_cpu_max_isa=SSE4_2``/``AVX``): probed once with one jitted expression."""
    global _XLA_CPU_FMA
    if _XLA_CPU_FMA is None:
        rng = np.random.default_rng(5)
        a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
        cpu = jax.devices("cpu")[0]
        f = jax.jit(lambda a, b, c: a * b + c)
        got = np.asarray(f(*(jax.device_put(x, cpu) for x in (a, b, c)))).view(np.uint32)
        if np.array_equal(got, C.fma_f32(a, b, c).view(np.uint32)):
            _XLA_CPU_FMA = True
        elif np.array_equal(got, (a * b + c).view(np.uint32)):
            _XLA_CPU_FMA = False
        else:
            warnings.warn(
                "TrainStream: XLA:CPU's a*b + c is neither fused nor two roundings on this "
                "host; convention='optax' on the CPU may differ from optax.adamw in the last bit",
                RuntimeWarning,
                stacklevel=4,
            )
            _XLA_CPU_FMA = True
    return _XLA_CPU_FMA


# -- the FFI target --------------------------------------------------------------------------

_registered = False
_register_lock = threading.Lock()


def _handler_instance(ctx: xf.CallContext, args: list, rets: list) -> tuple[_Instance, int]:
    inst = _instance(ctx.attrs.get("handle"))
    fp = ctx.attrs.get("structure")
    n = (len(args) - 2) // 2
    if fp != inst.fingerprint or n != inst.n or len(rets) != n + 1:
        raise ValueError(
            f"TrainStream offload_adamw: this program was traced for a pytree with {n} leaves "
            f"(structure {fp}) but engine {inst.handle} holds {inst.n} leaves (structure "
            f"{inst.fingerprint}): the pytree changed since init"
        )
    platform = "cpu" if ctx.is_cpu else "cuda"
    if platform != inst.platform:
        raise ValueError(
            f"TrainStream offload_adamw: engine {inst.handle} was initialised for parameters on "
            f"{inst.platform} but this program runs on {ctx.platform}: keep the parameters "
            "on the device they were on at init"
        )
    return inst, n


def _ffi_handler(ctx: xf.CallContext, args: list, rets: list) -> None:
    """XLA:CPU: ``(count', dyn, *grads, *params) -> (count', *new params)``."""
    inst, n = _handler_instance(ctx, args, rets)
    count_inc = int(xf.as_numpy(args[0], readonly=True))
    dyn = xf.as_numpy(args[1], readonly=True)
    grads = [xf.as_numpy(b) for b in args[2 : 2 + n]]  # never written (writable: one Numba signature)
    outs = [xf.as_numpy(b) for b in rets[1:]]
    xf.alias_or_copy(ctx, args[0], rets[0])  # the new count: aliased, normally no copy
    inst.run(count_inc, dyn, grads, outs)


def _ffi_handler_cuda(ctx: xf.CallContext, args: list, rets: list) -> None:
    """XLA:GPU: the same signature, device buffers, everything on ``ctx.stream()``."""
    inst, n = _handler_instance(ctx, args, rets)
    stream = ctx.stream()
    if ctx.device_ordinal() != inst.device:
        raise ValueError(
            f"TrainStream offload_adamw: engine {inst.handle} holds the state of parameters on "
            f"cuda:{inst.device}, this program runs on cuda:{ctx.device_ordinal()}"
        )
    xf.alias_or_copy(ctx, args[0], rets[0])
    for p, o in zip(args[2 + n :], rets[1:]):
        xf.alias_or_copy(ctx, p, o)  # aliased (XLA copies a non-donated input first)
    inst.run_cuda(stream, args[0], args[1], list(args[2 : 2 + n]), list(rets[1:]))


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _ensure_registered() -> None:
    global _registered
    if _registered:
        return
    with _register_lock:
        if not _registered:
            xf.register_python_handler(_TARGET, _ffi_handler, "cpu")
            if _has_gpu():
                xf.register_python_handler(_TARGET, _ffi_handler_cuda, "gpu")
            _registered = True


# -- the transformation ----------------------------------------------------------------------


def _is_traced(*trees) -> bool:
    return any(isinstance(x, jax.core.Tracer) for t in trees for x in jax.tree.leaves(t))


def _leaf_dtype_name(x, path: str) -> str:
    dt = np.dtype(x.dtype)
    if dt not in _DTYPES:
        raise TypeError(
            f"TrainStream offload_adamw supports float32, float16 and bfloat16 parameters; "
            f"leaf {path} has dtype {dt}"
        )
    return _DTYPES[dt]


def _placement(leaves, paths, what: str) -> tuple[str, int]:
    """``("cpu" | "cuda", device ordinal)`` of the leaves, which must share one device."""
    where = None
    for x, p in zip(leaves, paths):
        devs = getattr(x, "devices", None)
        devs = list(devs()) if devs is not None else []
        if len(devs) > 1:
            raise NotImplementedError(
                f"TrainStream offload_adamw: {what} {p} is sharded over {len(devs)} devices; "
                "this release offloads single-device arrays only (one process per GPU)"
            )
        if not devs:
            continue
        d = devs[0]
        if d.platform == "cpu":
            here = ("cpu", 0)
        elif d.platform in ("gpu", "cuda"):
            ordinal = getattr(d, "local_hardware_id", None)
            here = ("cuda", int(d.id if ordinal is None else ordinal))
        else:
            raise NotImplementedError(
                f"TrainStream offload_adamw: {what} {p} is on {d} ({d.platform}); supported are "
                "the CPU and CUDA GPUs"
            )
        if where is None:
            where = here
        elif here != where:
            raise ValueError(
                f"TrainStream offload_adamw: {what} {p} is on {d}, other leaves on "
                f"{where[0]}:{where[1]}: every leaf must be on the same device"
            )
    return where or ("cpu", 0)


def _check_devices(leaves, paths, what: str, inst: _Instance) -> None:
    platform, device = _placement(leaves, paths, what)
    if (platform, device) != (inst.platform, inst.device if platform == "cuda" else 0):
        raise ValueError(
            f"TrainStream offload_adamw: the {what}s are on {platform}:{device}, the optimizer "
            f"state was initialised for parameters on {inst.platform}:{inst.device}"
        )


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class _Impl:
    def __init__(self, cfg: _Config):
        self.cfg = cfg
        self.specs: set = set()  # structures this transformation was initialised for
        self._eager_fns: dict = {}  # CUDA: (handle, structure) -> jitted FFI step
        self._scalars_jit = jax.jit(self._scalars)

    # -- in-graph scalars ----------------------------------------------------------------

    def _scalars(self, count, grads):
        """``count'`` and float32[5] = [-lr, d1, d2, clip divisor, clip factor], as optax."""
        cfg = self.cfg
        count_inc = optax.safe_increment(count)
        if callable(cfg.learning_rate):
            neg_lr = jnp.asarray(-1 * cfg.learning_rate(count), jnp.float32)  # scale_by_schedule
        else:
            neg_lr = jnp.asarray(-cfg.learning_rate, jnp.float32)
        d1 = 1 - cfg.b1**count_inc  # optax.tree.bias_correction
        d2 = 1 - cfg.b2**count_inc
        one = jnp.ones([], jnp.float32)
        if cfg.max_grad_norm is None or cfg.convention != "optax":
            div = mul = one
        else:  # optax.clip_by_global_norm, its norm of the float32 gradients
            norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
            trigger = norm < cfg.max_grad_norm
            div = jnp.where(trigger, one, norm)
            mul = jnp.where(trigger, one, jnp.asarray(cfg.max_grad_norm, jnp.float32))
        dyn = jnp.stack([x.astype(jnp.float32) for x in (neg_lr, d1, d2, div, mul)])
        return count_inc.astype(jnp.int32), dyn

    # -- optax API -------------------------------------------------------------------------

    def init(self, params) -> OffloadAdamWState:
        cfg = self.cfg
        if _is_traced(params):
            raise TypeError(
                "TrainStream offload_adamw: init(params) must run outside jax.jit (it allocates "
                "the host state and copies the parameters into it)"
            )
        leaves, treedef = jax.tree.flatten(params)
        paths = _paths(params)
        for x, p in zip(leaves, paths):
            _leaf_dtype_name(x, p)
        platform, device = _placement(leaves, paths, "parameter")
        if cfg.mode == "gpu":
            _check_gpu_mode(platform, cfg)
        decay = _resolve_mask(cfg.mask, params, treedef, "mask", True)
        fused = _resolve_mask(cfg.xla_fused_grads, params, treedef, "xla_fused_grads", False)
        with _instances_lock:
            handle = next(_handles)
            inst = _Instance(handle, cfg, leaves, treedef, decay, fused, platform, device)
            _instances[handle] = inst
        self.specs.add(inst.spec)
        zero = jnp.zeros([], jnp.int32)
        if platform == "cuda":
            zero = jax.device_put(zero, leaves[0].devices().pop() if leaves else None)
        return OffloadAdamWState(handle=EngineHandle(handle), count=zero)

    def _check_trees(self, grads, state, params):
        if params is None:
            raise ValueError("TrainStream offload_adamw: update needs params (update(grads, state, params))")
        if not isinstance(state, OffloadAdamWState):
            raise TypeError(f"TrainStream offload_adamw: expected an OffloadAdamWState, got {type(state).__name__}")
        p_leaves, p_def = jax.tree.flatten(params)
        g_leaves, g_def = jax.tree.flatten(grads)
        if g_def != p_def:
            raise ValueError(
                f"TrainStream offload_adamw: gradients and parameters have different pytree "
                f"structures:\n  grads:  {g_def}\n  params: {p_def}"
            )
        paths = _paths(params)
        for g, p, path in zip(g_leaves, p_leaves, paths):
            _leaf_dtype_name(p, path)
            if tuple(np.shape(g)) != tuple(np.shape(p)) or np.dtype(g.dtype) != np.dtype(p.dtype):
                raise ValueError(
                    f"TrainStream offload_adamw: gradient {path} has shape {tuple(np.shape(g))} and "
                    f"dtype {g.dtype}, its parameter {tuple(np.shape(p))} {p.dtype} (the gradient "
                    "must have the parameter's dtype: it is staged in that dtype)"
                )
        spec = _spec_of(p_leaves, p_def)
        if self.specs and spec not in self.specs:
            raise ValueError(
                "TrainStream offload_adamw: the parameter pytree (structure, shapes or dtypes) "
                "differs from the one passed to init:\n  now:  "
                f"{_describe(spec)}\n  init: " + "\n        ".join(_describe(s) for s in self.specs)
            )
        return p_leaves, g_leaves, p_def, spec

    def step(self, grads, state, params):
        """One update; returns ``(new_params, new_state)`` (the exact new weights)."""
        p_leaves, g_leaves, p_def, spec = self._check_trees(grads, state, params)
        if _is_traced(grads, state, params):
            new = self._step_traced(g_leaves, state, p_leaves, spec)
        else:
            new = self._step_eager(grads, g_leaves, state, p_leaves, spec)
        new_leaves, count = new
        return jax.tree.unflatten(p_def, new_leaves), OffloadAdamWState(state.handle, count)

    def update(self, updates, state, params=None):
        """optax API: ``(params_new - params, new_state)`` (see the module doc on exactness)."""
        new_params, new_state = self.step(updates, state, params)
        return jax.tree.map(lambda n, p: n - p, new_params, params), new_state

    # -- the two paths -----------------------------------------------------------------------

    def _step_traced(self, g_leaves, state, p_leaves, spec):
        inst = _instance(state.handle)
        _ensure_registered()
        grads_tree = g_leaves  # optax.tree.norm over the leaves in tree order
        count_inc, dyn = self._scalars(state.count, grads_tree)
        n = len(p_leaves)
        if inst.gpu_mode:  # the whole scalar matrix, in the program (read by the kernels)
            cols = [C.S_NEG_LR, C.S_BC1, C.S_BC2_OPTAX, C.S_CLIP_DIV, C.S_CLIP]
            k = 5 if self.cfg.max_grad_norm is not None else 3
            dyn = jnp.asarray(inst.templ).at[:, jnp.asarray(cols[:k])].set(jnp.broadcast_to(dyn[:k], (n, k)))
        result = [jax.ShapeDtypeStruct((), jnp.int32)] + [
            jax.ShapeDtypeStruct(np.shape(p), p.dtype) for p in p_leaves
        ]
        aliases = {0: 0}
        aliases.update({2 + n + i: 1 + i for i in range(n)})
        call = xf.stateful_ffi_call(_TARGET, result, input_output_aliases=aliases)
        outs = call(count_inc, dyn, *g_leaves, *p_leaves, handle=int(inst.handle), structure=_fingerprint(spec))
        return list(outs[1:]), outs[0]

    def _step_eager(self, grads, g_leaves, state, p_leaves, spec):
        inst = _instance(state.handle)
        if inst.spec != spec:
            raise ValueError(
                "TrainStream offload_adamw: the parameter pytree differs from the one this state "
                f"was initialised with:\n  now:  {_describe(spec)}\n  init: {_describe(inst.spec)}"
            )
        paths = _paths(grads)
        _check_devices(g_leaves, paths, "gradient", inst)
        _check_devices(p_leaves, paths, "parameter", inst)
        if inst.platform == "cuda":
            # The same FFI program, dispatched through a cached jit: the device arrays go
            # in as they are (no copy to the host, no DLPack round trip needed).
            return self._eager_cuda(inst, spec)(g_leaves, state.count, p_leaves)
        count_inc, dyn = self._scalars_jit(state.count, g_leaves)
        g_np = [np.asarray(g) for g in g_leaves]  # zero-copy views of the CPU buffers
        outs = [_aligned_empty(np.shape(p), np.dtype(p.dtype)) for p in p_leaves]
        inst.run(int(count_inc), np.asarray(dyn), g_np, outs)
        return [jax.device_put(o) for o in outs], count_inc  # adopts the aligned buffers

    def _eager_cuda(self, inst: _Instance, spec):
        key = (inst.handle, spec)
        fn = self._eager_fns.get(key)
        if fn is None:
            handle = EngineHandle(inst.handle)

            def eager_step(g_leaves, count, p_leaves):
                return self._step_traced(g_leaves, OffloadAdamWState(handle, count), p_leaves, spec)

            fn = self._eager_fns[key] = jax.jit(eager_step)
        return fn


def _describe(spec: tuple) -> str:
    treedef, leaves = spec
    return f"{treedef} with leaves {[f'{s}:{d}' for s, d in leaves]}"


def _check_gpu_mode(platform: str, cfg: _Config) -> None:
    """``mode="gpu"``: a CUDA GPU, parameters on it, the optax convention."""
    if not _has_gpu():
        raise RuntimeError(
            "TrainStream offload_adamw: mode='gpu' (the zero-copy GPU kernel) needs a CUDA GPU "
            f"visible to JAX; this process has none (jax.devices() = {jax.devices()})"
        )
    if platform != "cuda":
        raise ValueError(
            "TrainStream offload_adamw: mode='gpu' updates the weights on the GPU, but the "
            "parameters are on the CPU: put them on the GPU first (jax.device_put(params, "
            "jax.devices('gpu')[0])), or use mode='cpu'"
        )
    if cfg.convention != "optax":
        raise NotImplementedError(
            "TrainStream offload_adamw: mode='gpu' implements convention='optax' only (its scalars "
            "are computed inside the XLA program; the torch convention's are host float64 "
            "values per step, not wired into the FFI call). Use mode='cpu' for convention='torch'"
        )


def _resolve_mask(mask, params, treedef, name: str, default: bool) -> list[bool]:
    """optax's ``mask=``: a pytree (prefix) of bools or a callable params -> such a tree.

    Resolved once, at init (the mask of optax.masked is structural in practice).
    """
    n = treedef.num_leaves
    if mask is None:
        return [default] * n
    m = mask(params) if callable(mask) else mask
    try:
        full = jax.tree.map(lambda mk, sub: jax.tree.map(lambda _: bool(mk), sub), m, params)
        flags = treedef.flatten_up_to(full)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"TrainStream offload_adamw: {name} must be a pytree prefix of the parameters with "
            f"bool leaves (or a callable returning one): {exc}"
        ) from None
    return [bool(f) for f in flags]


class OffloadAdamW(optax.GradientTransformation):
    """The :class:`optax.GradientTransformation` returned by :func:`offload_adamw`.

    ``init`` / ``update`` as optax; in addition:

    * ``step(grads, state, params) -> (new_params, new_state)``: the exact new weights
      (use this rather than ``optax.apply_updates(params, updates)``, see
      :func:`offload_adamw`);
    * ``state_dict(state)``, ``load_state_dict(state, sd)``, ``stats(state)``,
      ``close(state)``: the module functions of the same names.
    """

    __slots__ = ()

    def step(self, grads, state, params):
        return self.update.__self__.step(grads, state, params)

    @staticmethod
    def state_dict(state, params=None) -> dict:
        return state_dict(state, params)

    @staticmethod
    def load_state_dict(state, sd: dict) -> OffloadAdamWState:
        return load_state_dict(state, sd)

    @staticmethod
    def stats(state) -> dict:
        return stats(state)

    @staticmethod
    def close(state) -> None:
        close(state)


def offload_adamw(
    learning_rate: float | Callable,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    max_grad_norm: float | None = None,
    mask: Any = None,
    xla_fused_grads: Any = None,
    mode: str = "cpu",
    convention: str = "optax",
    threads: int | None = None,
    chunk_elems: int = 1 << 20,
    worker_nice: int = 5,
) -> OffloadAdamW:
    """``optax.adamw`` with its state (fp32 moments and master weights) in host memory.

    Args:
      learning_rate: a float or an optax schedule (``count -> lr``), as ``optax.adamw``.
      b1, b2, eps, weight_decay: as ``optax.adamw`` (``eps_root`` = 0, no Nesterov).
      max_grad_norm: if given, the result is that of
        ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(...))``
        (the norm of the float32-upcast gradients, computed in-graph by optax's function).
        With ``convention="torch"``: ``clip_grad_norm_``'s coefficient from the engine's
        float64 norm (as ``trainstream.torch``).
      mask: as ``optax.adamw``'s ``mask`` (leaves with False get no weight decay);
        resolved once, at ``init``.
      xla_fused_grads: like ``mask``: True for the leaves whose gradient XLA:CPU fuses
        into optax's moment update in the reference program (see "Fused gradients" in
        :mod:`trainstream.contract`: LLVM then pairs the FMAs differently). Default
        none: gradients materialised before the update, which holds for gradients made by
        matmuls and multi-element reductions and whenever ``update`` is jitted apart from
        the gradient. Ignored with ``max_grad_norm`` and with ``convention="torch"``.
      mode: ``"cpu"``: the host updates the state (Numba kernels on worker threads); on a
        GPU the handler copies the gradients to pinned memory and uploads the new weights,
        both on XLA's stream. ``"gpu"``: the zero-copy kernel updates the weights on the
        GPU, reading and writing the state in mapped host memory over PCIe, launched on
        XLA's stream (parameters on a CUDA device, ``convention="optax"``).
      convention: ``"optax"`` (XLA:CPU's optax.adamw, bit for bit) or ``"torch"``
        (``torch.optim.AdamW`` on the CPU, bit for bit; needs torch importable).
      threads, chunk_elems: engine worker threads and chunk size.
      worker_nice: ``mode="cpu"``: the worker threads' nice value (Linux applies it per
        thread). The default, 5, lets them yield the CPU to the threads that drive the
        device (see ``trainstream.torch.OffloadAdamW``'s ``worker_nice`` for what 19 did).

    Exactness. On the CPU backend, under ``jax.jit`` (and eagerly) the new weights equal
    those of the jitted optax train step ``u, s = opt.update(g, s, p); p =
    optax.apply_updates(p, u)`` on XLA:CPU, for fp32 leaves; fp16/bf16 leaves keep an fp32 master that equals what
    optax computes on fp32 parameters fed the upcast gradients, and return its rounding.
    Use ``tx.step(grads, state, params) -> (new_params, new_state)`` for those exact
    weights. ``update`` returns ``new - params`` as optax expects, and
    ``optax.apply_updates(params, new - params)`` gives back exactly ``new`` wherever
    ``new - params`` is exact in the leaf's dtype: by Sterbenz's lemma whenever
    ``params/2 <= new <= 2*params`` (same sign; the usual small step), or either is 0,
    and the difference is not subnormal (XLA:CPU flushes it to zero). It can differ by
    rounding where a weight halves, doubles or changes sign in one step.

    On a CUDA GPU, XLA:GPU's optax uses the approximate ``sqrt.approx``/``div.full``
    instructions: ``mode="gpu"`` runs the same instructions (the ``optax``/``cuda``
    convention of :mod:`trainstream.contract`; measured bit-identical per step, bound
    ``OPTAX_CUDA_MAX_ULP``), ``mode="cpu"`` the IEEE ones on the host: its moments stay
    within ``OPTAX_CUDA_HOST_MAX_ULP`` of optax's per step, its weights within a small
    fraction of the step (their ULPs grow where Adam's ``m`` nearly cancels; see the
    contract). With clipping, optax's norm is XLA's float32 sum, whose last bits depend on
    the program that computes it.

    With ``max_grad_norm`` the global norm is computed by XLA (optax's own
    ``optax.tree.norm``) inside the program that calls the update: under ``jax.jit``
    that is the user's train step, eagerly a small program of its own. XLA's float32 sum
    can differ in the last bit from one program to another, so the weights equal optax's
    when optax's norm comes from the same kind of program (e.g. the jitted optax train
    step for the jitted path); a norm computed elsewhere can flip the clip coefficient's
    last bit (see ``experiments/equivalence_jax.py``).

    The state: :class:`OffloadAdamWState` ``(handle, count)``. Only the state returned
    by the latest update is valid (the moments live in the engine; an older state is
    refused); checkpoint with :func:`state_dict` / :func:`load_state_dict`. Each ``init``
    starts an engine (host buffers and worker threads) that lives until
    ``tx.close(state)`` or the end of the process.
    """
    if mode not in ("cpu", "gpu"):
        raise ValueError(f"mode must be 'cpu' or 'gpu', got {mode!r}")
    if convention not in C.CONVENTIONS:
        raise ValueError(f"Unknown convention {convention!r}; expected one of {C.CONVENTIONS}")
    lr0 = 0.0 if callable(learning_rate) else learning_rate
    C.validate_hyperparams(lr0, (b1, b2), eps, weight_decay)
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
            raise TypeError(f"max_grad_norm must be a float, got {type(max_grad_norm).__name__}")
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite float, got {max_grad_norm}")
        max_grad_norm = float(max_grad_norm)
    if isinstance(worker_nice, bool) or not isinstance(worker_nice, int):
        raise ValueError(f"worker_nice must be an int, got {worker_nice!r}")
    if convention == "torch":
        _torch_sqrt_mode()  # refuse early without torch
    cfg = _Config(
        learning_rate if callable(learning_rate) else float(learning_rate),
        float(b1), float(b2), float(eps), float(weight_decay),
        max_grad_norm, mask, xla_fused_grads, mode, convention, threads, chunk_elems, worker_nice,
    )
    impl = _Impl(cfg)
    return OffloadAdamW(impl.init, impl.update)


# -- state export / import, stats, close ---------------------------------------------------------


def _wait_for(state: OffloadAdamWState) -> None:
    """Wait until the update that produced ``state`` has run (JAX dispatches
    asynchronously: the engine may not have seen it yet)."""
    try:
        jax.block_until_ready(state.count)
    except Exception:  # noqa: BLE001 - a failed step raised (or raises) at its own call
        pass


def state_dict(state: OffloadAdamWState, params=None) -> dict:
    """The host state as NumPy arrays, for checkpoints (e.g. orbax).

    ``{"count": int32 scalar, "master": tree, "exp_avg": tree, "exp_avg_sq": tree}``,
    the trees shaped like the parameters (float32). Resuming from it with
    :func:`load_state_dict` continues bit for bit, in either mode.

    ``params``: needed in ``mode="gpu"`` when there are float32 leaves (their weights
    are their own master and live on the GPU, not in the engine); ignored otherwise.
    """
    inst = _instance(state.handle)
    _wait_for(state)
    inst.synchronize_device()
    p_leaves = None
    if inst.gpu_mode and "float32" in inst.dtypes:
        if params is None:
            raise ValueError(
                "TrainStream state_dict: in mode='gpu' the float32 weights are their own master "
                "and live on the GPU: call state_dict(state, params)"
            )
        p_leaves, p_def = jax.tree.flatten(params)
        if p_def != inst.treedef:
            raise ValueError(f"TrainStream state_dict: params have structure {p_def}, expected {inst.treedef}")
    with inst.lock:
        cols: dict[str, list] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
        step = 0
        for i in range(inst.n):
            leaf = inst.leaves[i]
            if p_leaves is not None and inst.dtypes[i] == "float32":
                leaf.init = np.asarray(p_leaves[i], np.float32).reshape(-1)
            try:
                p, m, v, step = inst.engine.state(i)
            finally:
                leaf.init = None
            for k, a in zip(cols, (p, m, v)):
                cols[k].append(a.reshape(inst.shapes[i]))
    count = np.asarray(state.count, np.int32)
    if inst.n and int(count) != step and not (int(count) == _I32_MAX):
        raise RuntimeError(
            f"TrainStream state_dict: the state has count {int(count)} but engine {inst.handle} "
            f"made {step} updates (pass the state returned by the latest update)"
        )
    out = {k: jax.tree.unflatten(inst.treedef, v) for k, v in cols.items()}
    out["count"] = count
    return out


def load_state_dict(state: OffloadAdamWState, sd: dict) -> OffloadAdamWState:
    """Restore :func:`state_dict` output into the engine of ``state`` (from ``tx.init``).

    Checks that the checkpoint has the structure, shapes and keys of the parameters the
    state was initialised with; returns the state to continue with (its ``count``).
    """
    inst = _instance(state.handle)
    missing = {"count", "master", "exp_avg", "exp_avg_sq"} - set(sd)
    if missing:
        raise ValueError(f"TrainStream load_state_dict: checkpoint lacks {sorted(missing)}")
    count = int(np.asarray(sd["count"]))
    if not 0 <= count <= _I32_MAX:
        raise ValueError(f"TrainStream load_state_dict: count {count} out of range")
    arrays = {}
    for k in ("master", "exp_avg", "exp_avg_sq"):
        leaves, treedef = jax.tree.flatten(sd[k])
        if treedef != inst.treedef:
            raise ValueError(
                f"TrainStream load_state_dict: checkpoint {k!r} has pytree structure {treedef}, "
                f"the optimizer was initialised for {inst.treedef}"
            )
        for i, a in enumerate(leaves):
            if tuple(np.shape(a)) != inst.shapes[i]:
                raise ValueError(
                    f"TrainStream load_state_dict: checkpoint {k!r} leaf {i} has shape "
                    f"{tuple(np.shape(a))}, the parameter has {inst.shapes[i]}"
                )
            if np.dtype(np.asarray(a).dtype) != np.float32:
                raise ValueError(
                    f"TrainStream load_state_dict: checkpoint {k!r} leaf {i} has dtype "
                    f"{np.asarray(a).dtype}, expected float32"
                )
        arrays[k] = leaves
    _wait_for(state)
    inst.synchronize_device(check=False)
    if inst.gpu_mode:
        inst.count_check.completed(block=True)  # drop the read-backs of earlier steps
    inst.stale = None  # the checkpoint replaces whatever an old state did
    with inst.lock:
        for i in range(inst.n):
            inst.engine.load_state(
                i, arrays["exp_avg"][i], arrays["exp_avg_sq"][i], count, master=arrays["master"][i]
            )
        inst.engine.clear_error()  # every slot is consistent again (a worker failure is over)
    new_count = jnp.asarray(count, jnp.int32)
    devs = getattr(state.count, "devices", None)
    if devs is not None:
        new_count = jax.device_put(new_count, next(iter(devs())))
    return OffloadAdamWState(handle=state.handle, count=new_count)


def stats(state: OffloadAdamWState) -> dict:
    """The engine's counters (bytes moved, state bytes, milliseconds), as ``trainstream.torch``."""
    inst = _instance(state.handle)
    _wait_for(state)
    return inst.engine.stats()


def close(state: OffloadAdamWState) -> None:
    """Release the engine of ``state`` (worker threads and host memory); idempotent."""
    try:
        inst = _instance(state.handle)
    except KeyError:
        return
    _wait_for(state)
    with _instances_lock:
        _instances.pop(inst.handle, None)
    inst.synchronize_device(check=False)
    with inst.lock:
        inst.engine.close()
