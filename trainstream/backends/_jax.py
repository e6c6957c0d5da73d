"""JAX adapter: ``offload_adamw``, an optax-style AdamW whose state lives in host memory.

No arithmetic lives here: the update is the engine's (``trainstream._engine``), whose
arithmetic is the contract's (``trainstream._contract``). This module computes, inside
the user's jitted program, the per-step inputs that only XLA can reproduce (bias
corrections through glibc ``powf``, the learning-rate schedule, optax's global norm),
hands them with the gradients to the engine through an XLA typed-FFI call whose handler
is Python (``trainstream.backends._xla_ffi``), and returns the new parameters.

Data path (``mode="cpu"``, JAX on the CPU backend: everything is host memory)::

    jitted step:  count' = safe_increment(count)
                  scalars = [-lr, 1 - b1**count', 1 - b2**count', clip divisor, clip factor]
                  count', new_params = ffi("trainstream_adamw_update")(
                      handle, count', scalars, *grads, *params)   # params aliased -> outputs
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
dispatch path (:func:`~trainstream.backends._xla_ffi.stateful_ffi_call`). Per-step values
travel as a float32[5] operand, so the program compiles once.

Eagerly (outside ``jax.jit``) the same scalars come from one small jitted function and the
engine reads the gradients through zero-copy NumPy views of the JAX buffers; the new
weights are written into fresh 64-byte-aligned host buffers that ``jax.device_put``
adopts without a copy.

Not built (refused with ``NotImplementedError``): ``mode="gpu"`` and any parameter on a
CUDA device. The XLA:GPU FFI path (the zero-copy kernel of ``kernels/`` launched on
XLA's stream, or the cpu-mode pipeline ordered on that stream) was not built, because it
could not be validated on a GPU in this release.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _contract as C
from .. import _cpu_sqrt
from .._engine import Engine
from . import _xla_ffi as xf

__all__ = [
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


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised host array whose data is ``align``-byte aligned (XLA:CPU adopts
    such buffers in ``device_put`` without a copy)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(n * dt.itemsize + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + n * dt.itemsize].view(dt).reshape(shape)


class _HostBuffer:
    __slots__ = ("array", "handle", "pinned")

    def __init__(self, array: np.ndarray):
        self.array = array
        self.handle = array
        self.pinned = False


class _Leaf:
    """The engine's ``param`` of one leaf: where its new weights go this step."""

    __slots__ = ("index", "init", "out")

    def __init__(self, index: int, init: np.ndarray):
        self.index = index
        self.init = init  # float32, flat: the weights at registration
        self.out: np.ndarray | None = None  # flat view of this step's output (bits for 16-bit)


class JaxCpuBackend:
    """The engine :class:`~trainstream._engine.Backend` for JAX CPU arrays.

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
            return _HostBuffer(_aligned_empty((numel,), np_dtype))
        except MemoryError as exc:
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


class OffloadAdamWState(NamedTuple):
    """The optax state of :func:`offload_adamw`.

    ``handle``: int32 scalar, the key of the engine (host state) in this process's
    registry. ``count``: int32 scalar, the number of updates so far (optax's ``count``).
    The moments and master weights live in the engine: export them with
    :func:`state_dict`.
    """

    handle: Any
    count: Any


def _spec_of(leaves, treedef) -> tuple:
    return (str(treedef), tuple((tuple(np.shape(x)), np.dtype(x.dtype).name) for x in leaves))


def _fingerprint(spec: tuple) -> str:
    return hashlib.sha1(repr(spec).encode()).hexdigest()[:16]


# -- the registry of live engines ----------------------------------------------------------------


class _Instance:
    """One ``init``: an engine, the structure it was built for, and per-leaf constants."""

    def __init__(self, handle: int, cfg: _Config, leaves, treedef, decay: list[bool], fused: list[bool]):
        self.handle = handle
        self.cfg = cfg
        self.treedef = treedef
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [_DTYPES[np.dtype(x.dtype)] for x in leaves]
        self.spec = _spec_of(leaves, treedef)
        self.fingerprint = _fingerprint(self.spec)
        self.lock = threading.Lock()
        n = len(leaves)
        sqrt_mode = _torch_sqrt_mode() if cfg.convention == "torch" else 0
        self.backend = JaxCpuBackend()
        self.engine = Engine(
            self.backend,
            mode="cpu",
            threads=cfg.threads,
            chunk_elems=cfg.chunk_elems,
            convention=cfg.convention,
            cpu_sqrt_mode=sqrt_mode,
        )
        self.leaves: list[_Leaf] = []
        base_lr = 0.0 if callable(cfg.learning_rate) else float(cfg.learning_rate)
        self.hps = []
        templ = np.zeros((n, C.N_SCALARS), np.float32)
        for i, x in enumerate(leaves):
            leaf = _Leaf(i, np.asarray(x).astype(np.float32).reshape(-1))
            sid = self.engine.add_param(leaf, leaf.init.size, self.dtypes[i], "cpu")
            assert sid == i
            leaf.init = None  # the engine's master holds it now
            self.leaves.append(leaf)
            wd = cfg.weight_decay if decay[i] else 0.0
            hp = C.AdamWHyperParams(base_lr, cfg.b1, cfg.b2, cfg.eps, wd)
            self.hps.append(hp)
            if cfg.convention == "optax":
                numel = int(np.prod(self.shapes[i], dtype=np.int64))
                code = C.optax_cpu_code(n, numel, cfg.max_grad_norm, fused_grad=fused[i])
                templ[i] = C.optax_step_scalars(hp, 1.0, 1.0, code=code, decay=decay[i] and wd != 0.0)
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

    def run(self, count_inc: int, dyn: np.ndarray, grads: list[np.ndarray], outs: list[np.ndarray]) -> None:
        """Update every leaf with ``grads``; write the new weights into ``outs``.

        ``count_inc``: the step number after increment; ``dyn``: the float32[5] in-graph
        scalars. ``grads``/``outs``: NumPy arrays of the leaves' shapes and dtypes.
        """
        eng = self.engine
        with self.lock:
            if eng.closed:
                raise RuntimeError(f"TrainStream offload_adamw: engine {self.handle} is closed")
            self.check_buffers(grads, outs)
            done = eng.get_step(0) if self.n else 0
            if count_inc != done + 1 and not (count_inc == _I32_MAX and done >= _I32_MAX - 1):
                raise RuntimeError(
                    f"TrainStream offload_adamw: the optimizer state passed in has count "
                    f"{count_inc - 1} but engine {self.handle} has made {done} updates. The moments "
                    "live in host memory, so only the state returned by the previous update is "
                    "valid (an old state cannot be reused; restore a checkpoint with "
                    "load_state_dict instead)"
                )
            ok = False
            try:
                for i, leaf in enumerate(self.leaves):
                    leaf.out = _flat_bits(outs[i])
                for i in range(self.n):
                    eng.offload_grad(i, _flat_bits(grads[i]), self.dtypes[i])
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


def _flat_bits(a: np.ndarray) -> np.ndarray:
    """A flat view of ``a`` as the engine's buffers hold it (uint16 bits for fp16/bf16)."""
    a = a.reshape(-1)
    return a if a.dtype == np.float32 else a.view(np.uint16)


_instances: dict[int, _Instance] = {}
_instances_lock = threading.Lock()
_handles = itertools.count(1)


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
    try:
        import torch
    except ImportError:
        raise RuntimeError(
            "convention='torch' reproduces torch.optim.AdamW on the CPU, whose sqrt is MKL's "
            "and differs from CPU to CPU; TrainStream finds which one by probing torch.sqrt, "
            "so torch must be importable (pip install torch), or use convention='optax'"
        ) from None
    mode = _cpu_sqrt.detect_mode(lambda x: torch.from_numpy(np.ascontiguousarray(x, np.float32)).sqrt().numpy())
    if mode is None:
        warnings.warn(
            "TrainStream: torch.sqrt on this CPU matches none of the known MKL paths; "
            "convention='torch' may differ from torch.optim.AdamW in the last bit",
            RuntimeWarning,
            stacklevel=4,
        )
        mode = _cpu_sqrt.IEEE
    return mode


# -- the FFI target --------------------------------------------------------------------------

_registered = False
_register_lock = threading.Lock()


def _ffi_handler(ctx: xf.CallContext, args: list, rets: list) -> None:
    inst = _instance(xf.as_numpy(args[0], readonly=True))
    fp = ctx.attrs.get("structure")
    n = (len(args) - 3) // 2
    if fp != inst.fingerprint or n != inst.n or len(rets) != n + 1:
        raise ValueError(
            f"TrainStream offload_adamw: this program was traced for a pytree with {n} leaves "
            f"(structure {fp}) but engine {inst.handle} holds {inst.n} leaves (structure "
            f"{inst.fingerprint}): the pytree changed since init"
        )
    count_inc = int(xf.as_numpy(args[1], readonly=True))
    dyn = xf.as_numpy(args[2], readonly=True)
    grads = [xf.as_numpy(b) for b in args[3 : 3 + n]]  # never written (writable: one Numba signature)
    outs = [xf.as_numpy(b) for b in rets[1:]]
    xf.alias_or_copy(ctx, args[1], rets[0])  # the new count: aliased, normally no copy
    inst.run(count_inc, dyn, grads, outs)


def _ensure_registered() -> None:
    global _registered
    if _registered:
        return
    with _register_lock:
        if not _registered:
            xf.register_python_handler(_TARGET, _ffi_handler, "cpu")
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


def _check_devices(leaves, paths, what: str) -> None:
    for x, p in zip(leaves, paths):
        devs = getattr(x, "devices", None)
        if devs is None:
            continue
        for d in devs():
            if d.platform != "cpu":
                raise NotImplementedError(
                    f"TrainStream offload_adamw: {what} {p} is on {d} ({d.platform}). Only JAX "
                    "arrays on the CPU backend are supported in this release: the XLA:GPU FFI "
                    "path (zero-copy kernel on XLA's stream, or the cpu-mode pipeline ordered on "
                    "it) was not built because it could not be validated on a GPU"
                )


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class _Impl:
    def __init__(self, cfg: _Config):
        self.cfg = cfg
        self.specs: set = set()  # structures this transformation was initialised for
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
        if cfg.mode == "gpu":
            _refuse_gpu_mode()
        _check_devices(leaves, paths, "parameter")
        decay = _resolve_mask(cfg.mask, params, treedef, "mask", True)
        fused = _resolve_mask(cfg.xla_fused_grads, params, treedef, "xla_fused_grads", False)
        with _instances_lock:
            handle = next(_handles)
            inst = _Instance(handle, cfg, leaves, treedef, decay, fused)
            _instances[handle] = inst
        self.specs.add(inst.spec)
        return OffloadAdamWState(handle=jnp.asarray(handle, jnp.int32), count=jnp.zeros([], jnp.int32))

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
        if self.cfg.mode == "gpu":
            _refuse_gpu_mode()
        _ensure_registered()
        grads_tree = g_leaves  # optax.tree.norm over the leaves in tree order
        count_inc, dyn = self._scalars(state.count, grads_tree)
        n = len(p_leaves)
        result = [jax.ShapeDtypeStruct((), jnp.int32)] + [
            jax.ShapeDtypeStruct(np.shape(p), p.dtype) for p in p_leaves
        ]
        aliases = {1: 0}
        aliases.update({3 + n + i: 1 + i for i in range(n)})
        call = xf.stateful_ffi_call(_TARGET, result, input_output_aliases=aliases)
        handle = jnp.asarray(state.handle, jnp.int32)
        outs = call(handle, count_inc, dyn, *g_leaves, *p_leaves, structure=_fingerprint(spec))
        return list(outs[1:]), outs[0]

    def _step_eager(self, grads, g_leaves, state, p_leaves, spec):
        if self.cfg.mode == "gpu":
            _refuse_gpu_mode()
        inst = _instance(state.handle)
        if inst.spec != spec:
            raise ValueError(
                "TrainStream offload_adamw: the parameter pytree differs from the one this state "
                f"was initialised with:\n  now:  {_describe(spec)}\n  init: {_describe(inst.spec)}"
            )
        paths = _paths(grads)
        _check_devices(g_leaves, paths, "gradient")
        _check_devices(p_leaves, paths, "parameter")
        count_inc, dyn = self._scalars_jit(state.count, g_leaves)
        g_np = [np.asarray(g) for g in g_leaves]  # zero-copy views of the CPU buffers
        outs = [_aligned_empty(np.shape(p), np.dtype(p.dtype)) for p in p_leaves]
        inst.run(int(count_inc), np.asarray(dyn), g_np, outs)
        return [jax.device_put(o) for o in outs], count_inc  # adopts the aligned buffers


def _describe(spec: tuple) -> str:
    treedef, leaves = spec
    return f"{treedef} with leaves {[f'{s}:{d}' for s, d in leaves]}"


def _refuse_gpu_mode():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        raise RuntimeError(
            "TrainStream offload_adamw: mode='gpu' (the zero-copy GPU kernel) needs a CUDA GPU "
            f"visible to JAX; this process has none (jax.devices() = {jax.devices()})"
        )
    raise NotImplementedError(
        "TrainStream offload_adamw: mode='gpu' for JAX is not built in this release: its XLA:GPU "
        "FFI handler (the zero-copy kernel launched on XLA's stream) could not be validated on a "
        "GPU. Use trainstream.torch.OffloadAdamW for gpu mode, or JAX on the CPU with mode='cpu'"
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
    def state_dict(state) -> dict:
        return state_dict(state)

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
        :mod:`trainstream._contract`: LLVM then pairs the FMAs differently). Default
        none: gradients materialised before the update, which holds for gradients made by
        matmuls and multi-element reductions and whenever ``update`` is jitted apart from
        the gradient. Ignored with ``max_grad_norm`` and with ``convention="torch"``.
      mode: ``"cpu"`` (host update). ``"gpu"`` is not built for JAX in this release.
      convention: ``"optax"`` (XLA:CPU's optax.adamw, bit for bit) or ``"torch"``
        (``torch.optim.AdamW`` on the CPU, bit for bit; needs torch importable).
      threads, chunk_elems: engine worker threads and chunk size.

    Exactness. Under ``jax.jit`` (and eagerly) the new weights equal those of the
    jitted optax train step ``u, s = opt.update(g, s, p); p = optax.apply_updates(p, u)``
    on XLA:CPU, for fp32 leaves; fp16/bf16 leaves keep an fp32 master that equals what
    optax computes on fp32 parameters fed the upcast gradients, and return its rounding.
    Use ``tx.step(grads, state, params) -> (new_params, new_state)`` for those exact
    weights. ``update`` returns ``new - params`` as optax expects, and
    ``optax.apply_updates(params, new - params)`` gives back exactly ``new`` wherever
    ``new - params`` is exact in the leaf's dtype: by Sterbenz's lemma whenever
    ``params/2 <= new <= 2*params`` (same sign; the usual small step), or either is 0,
    and the difference is not subnormal (XLA:CPU flushes it to zero). It can differ by
    rounding where a weight halves, doubles or changes sign in one step.

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
    if convention == "torch":
        _torch_sqrt_mode()  # refuse early without torch
    cfg = _Config(
        learning_rate if callable(learning_rate) else float(learning_rate),
        float(b1), float(b2), float(eps), float(weight_decay),
        max_grad_norm, mask, xla_fused_grads, mode, convention, threads, chunk_elems,
    )
    impl = _Impl(cfg)
    return OffloadAdamW(impl.init, impl.update)


# -- state export / import, stats, close ---------------------------------------------------------


def state_dict(state: OffloadAdamWState) -> dict:
    """The host state as NumPy arrays, for checkpoints (e.g. orbax).

    ``{"count": int32 scalar, "master": tree, "exp_avg": tree, "exp_avg_sq": tree}``,
    the trees shaped like the parameters (float32). Resuming from it with
    :func:`load_state_dict` continues bit for bit.
    """
    inst = _instance(state.handle)
    with inst.lock:
        cols: dict[str, list] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
        step = 0
        for i in range(inst.n):
            p, m, v, step = inst.engine.state(i)
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
    with inst.lock:
        for i in range(inst.n):
            inst.engine.load_state(
                i, arrays["exp_avg"][i], arrays["exp_avg_sq"][i], count, master=arrays["master"][i]
            )
    return OffloadAdamWState(handle=state.handle, count=jnp.asarray(count, jnp.int32))


def stats(state: OffloadAdamWState) -> dict:
    """The engine's counters (bytes moved, state bytes, milliseconds), as ``trainstream.torch``."""
    return _instance(state.handle).engine.stats()


def close(state: OffloadAdamWState) -> None:
    """Release the engine of ``state`` (worker threads and host memory); idempotent."""
    try:
        inst = _instance(state.handle)
    except KeyError:
        return
    with _instances_lock:
        _instances.pop(inst.handle, None)
    with inst.lock:
        inst.engine.close()
