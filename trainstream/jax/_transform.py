"""JAX adapter: ``offload_adamw``, optax.adamw whose state lives in host memory.

No arithmetic lives here: the per-step scalars are :func:`trainstream.contract.optax_scalar_matrix` in ``jax.numpy``
in the user's program (only XLA reproduces XLA's bias corrections, schedule and global norm); the update is a contract
kernel on XLA's buffers through ``buffer_callback`` (host workers, or XLA:GPU: :mod:`._gpu`; meshes: :mod:`._sharding`).
The callbacks are pure: the state goes in aliased to the outputs (in place where donated), nothing kept between calls.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import functools
import importlib
import math
import os
import threading
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.buffer_callback import buffer_callback
from jax.sharding import PartitionSpec as P

from .. import _cores
from .. import contract as C
from ..core import Engine, ExternalUpdate, _budget
from . import _gpu, _sharding

__all__ = ["OffloadAdamW", "OffloadAdamWState", "close", "load_state_dict", "offload_adamw", "state_dict"]

_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(jnp.bfloat16): "bfloat16"}


class OffloadAdamWState(NamedTuple):
    """The state of :func:`offload_adamw`, shaped as optax's ``ScaleByAdamState`` (so optax's wrappers, flax's
    ``nnx.Optimizer`` and orbax handle it as optax.adamw's). ``count``: int32, the updates so far. ``mu``, ``nu``:
    float32 trees shaped like the parameters. ``master``: the float32 master of each fp16/bf16 leaf, None for
    float32 leaves. On a GPU the moments and masters are ``memory_kind="pinned_host"`` arrays."""

    count: Any
    mu: Any
    nu: Any
    master: Any


# offload_adamw's checked arguments (threads None: decided when the first update is traced)
_Config = collections.namedtuple("_Config", "learning_rate b1 b2 eps weight_decay max_grad_norm mask xla_fused_grads "
                                 "after_clip mode convention threads chunk_size worker_nice host_margin")


class _NoSlots:
    """The engine backend of the JAX adapter: no slots, XLA's buffers go to ``Engine.update_external``."""

    def _refuse(self, *_, **__):
        raise NotImplementedError("TrainStream JAX adapter: its engine updates XLA's buffers, with no slots")

    host_empty = param_to_host_f32 = record_compute = copy_to_host = copy_to_device = wait_on_compute = _refuse


_engines: dict[tuple, Engine] = {}
_engines_lock = threading.Lock()


def _finish_in_flight() -> None:
    with contextlib.suppress(Exception):  # exiting; JAX's own hook reports a failed program
        jax.effects_barrier()


def _engine(convention: str, tc_code: int, threads: int, chunk: int, nice: int) -> Engine:
    """The host engine of a configuration, shared in this process for its lifetime (a forked child gets its own)."""
    key = (os.getpid(), convention, tc_code, threads, chunk, nice)
    if key not in _engines:  # every callback asks: no lock once it exists
        with _engines_lock:
            if key not in _engines:
                _engines[key] = Engine(_NoSlots(), mode="cpu", threads=threads, chunk_size=chunk,
                                       convention=convention, tc_code=tc_code, worker_nice=nice)
                # after the engine's finalizer, so first at exit: callbacks still in flight find live workers
                atexit.unregister(_finish_in_flight)
                atexit.register(_finish_in_flight)
    return _engines[key]


def _torch_cpu_code() -> int:
    """The contract's torch/cpu code (torch's sqrt path and lerp fusing, probed once)."""
    try:
        importlib.import_module("torch")  # torch itself, even where trainstream.torch was imported before
        from ..backends.torch import torch_cpu_code  # noqa: PLC0415
    except ImportError:
        raise RuntimeError("convention='torch' reproduces torch.optim.AdamW on the CPU, whose sqrt (MKL's) TrainStream "
                           "probes: torch must be importable (pip install torch), or use convention='optax'") from None
    return torch_cpu_code()


@functools.cache
def _xla_cpu_fma() -> bool:
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
    warnings.warn("TrainStream: XLA:CPU's a*b + c is neither fused nor two roundings on this host; convention='optax' "
                  "on the CPU may differ from optax.adamw in the last bit", RuntimeWarning, stacklevel=4)
    return True


def _is_none(x) -> bool:
    return x is None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout_key(params, leaves) -> tuple:
    return (jax.tree.structure(params), tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves))


def _leaf_dtype_name(x, path: str) -> str:
    dt = np.dtype(x.dtype)
    if dt not in _DTYPES:
        raise TypeError(f"TrainStream offload_adamw supports float32, float16 and bfloat16 parameters; "
                        f"leaf {path} has dtype {dt}")
    return _DTYPES[dt]


def _resolve_mask(mask, params, treedef, name: str, default: bool) -> list[bool]:
    """optax's ``mask=``: a pytree (prefix) of bools or a callable params -> such a tree."""
    if mask is None:
        return [default] * treedef.num_leaves
    m = mask(params) if callable(mask) else mask
    try:
        flags = treedef.flatten_up_to(jax.tree.map(lambda mk, sub: jax.tree.map(lambda _: bool(mk), sub), m, params))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"TrainStream offload_adamw: {name} must be a pytree prefix of the parameters with "
                         f"bool leaves (or a callable returning one): {exc}") from None
    return [bool(f) for f in flags]


def _platform_of(leaves) -> str:
    """``"cpu"`` or ``"cuda"``: where the arrays live (for tracers: the default backend)."""
    concrete = [x for x in leaves if not isinstance(x, jax.core.Tracer) and getattr(x, "devices", None) is not None]
    plats = {d.platform for x in concrete for d in x.devices()} or {jax.default_backend()}
    if len(plats) > 1:
        raise ValueError(f"TrainStream offload_adamw: the arrays are on several platforms {sorted(plats)}")
    (p,) = plats
    if p not in ("cpu", "gpu", "cuda"):
        raise NotImplementedError(f"TrainStream offload_adamw: platform {p!r}; supported are the CPU and CUDA GPUs")
    return "cpu" if p == "cpu" else "cuda"


def _host_numel(x) -> int:
    """Elements of leaf ``x`` whose state this process holds (its devices' shards)."""
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if sharding is None:
        return math.prod(np.shape(x))
    return len(sharding.addressable_devices) * math.prod(sharding.shard_shape(np.shape(x)))


def _check_host_state(mu, nu, master, paths) -> None:
    """On a GPU the moments and masters must arrive in host memory (else the state would silently live on the GPU)."""
    for what, leaves in (("mu", mu), ("nu", nu), ("master", master)):
        for x, path in zip(leaves, paths):
            if x is not None and getattr(jax.typeof(x), "memory_space", None) != jax.memory.Space.Host:
                raise ValueError(
                    f"TrainStream offload_adamw: the state's {what} of leaf {path} is {jax.typeof(x)} in GPU memory, "
                    "not in pinned host memory as tx.init places it: pass the state from init or update, or restore "
                    "to tx.init(params)'s shardings (orbax: jax.tree.map(ocp.utils.to_shape_dtype_struct, state))")


def _check_gpu_mode(platform: str, cfg: _Config) -> None:
    """``mode="gpu"`` needs a CUDA GPU, the parameters on it and the optax convention."""
    if cfg.mode != "gpu":
        return
    if platform != "cuda":
        with contextlib.suppress(RuntimeError):  # raised by jax.devices("gpu") without a GPU backend
            if jax.devices("gpu"):
                raise ValueError("TrainStream offload_adamw: mode='gpu' but the parameters are on the CPU: "
                                 "jax.device_put(params, jax.devices('gpu')[0]) first, or use mode='cpu'")
        raise RuntimeError("TrainStream offload_adamw: mode='gpu' (the GPU kernel) needs a CUDA GPU visible to "
                           f"JAX; this process has none (jax.devices() = {jax.devices()})")
    if cfg.convention != "optax":
        raise NotImplementedError("TrainStream offload_adamw: mode='gpu' implements convention='optax' only (the "
                                  "torch convention's scalars are host float64 values): use mode='cpu' for it")


class _Plan:
    """What the callbacks of one traced update need, shared by equal configurations; static (the compiled
    program keeps it through its callbacks), so it holds no array."""

    __slots__ = ("n", "kinds", "numels", "halves", "emit_u", "convention", "max_grad_norm", "hps", "schedule", "mode",
                 "engine_key", "gpu", "__weakref__")

    def __init__(self, cfg: _Config, kinds, numels, decay, emit_u: bool, platform: str):
        self.n, self.kinds, self.numels, self.emit_u = len(kinds), tuple(kinds), tuple(numels), emit_u
        self.halves = tuple(i for i, k in enumerate(kinds) if k != "float32")
        self.convention, self.max_grad_norm, self.mode = cfg.convention, cfg.max_grad_norm, cfg.mode
        self.schedule = callable(cfg.learning_rate)
        tc_code = _torch_cpu_code() if cfg.convention == "torch" else 0
        threads = cfg.threads or _cores.default_threads(_sharding._local_processes())
        self.engine_key = (cfg.convention, tc_code, threads, cfg.chunk_size, cfg.worker_nice)
        lr = 0.0 if self.schedule else cfg.learning_rate  # torch: float hyper-parameters (arrays are refused)
        self.hps = ([C.AdamWHyperParams(lr, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay if d else 0.0) for d in decay]
                    if cfg.convention == "torch" else None)
        self.gpu = _gpu._Update(self) if platform == "cuda" else None  # XLA:GPU's callback (XLA keys programs by it)

    @property
    def engine(self) -> Engine:
        return _engine(*self.engine_key)

    def torch_scalars(self, s_optax: np.ndarray, count_inc: int, grads: list) -> np.ndarray:
        """The torch convention's scalar matrix (host float64, from the contract) for the count after increment;
        with ``max_grad_norm`` the engine's float64 norm of ``grads`` (``(array, dtype, landed)``); a schedule's
        learning rate is XLA's, the optax matrix's ``S_NEG_LR``."""
        clip = (np.float32(1.0) if self.max_grad_norm is None else
                C.clip_coefficient(math.sqrt(self.engine.sumsq_external(grads)), self.max_grad_norm))
        rows = np.empty((self.n, C.N_SCALARS), np.float32)
        for i, hp in enumerate(self.hps):
            if self.schedule:
                hp = hp._replace(lr=-float(s_optax[i, C.S_NEG_LR]))
            rows[i] = C.torch_step_scalars(hp, count_inc, clip)
        return rows

    def __call__(self, ctx, outs, scal, count, *ins) -> None:
        """``(S, t, grads, params, mu, nu, masters) -> (firsts, mu', nu', masters')`` on XLA:CPU, ``firsts`` the
        new weights (``step``: aliased to the params) or ``u`` (``update``; a placeholder for fp16/bf16 leaves)."""
        n, view = self.n, _flat_view
        params, mus, nus = ins[n:2 * n], outs[n:2 * n], outs[2 * n:3 * n]
        master_of = dict(zip(self.halves, outs[3 * n:]))
        s = np.asarray(scal)
        g = [view(x, kind) for x, kind in zip(ins[:n], self.kinds)]
        if self.convention == "torch":
            s = self.torch_scalars(s, int(np.asarray(count)), [(a, k, None) for a, k in zip(g, self.kinds)])
        items = []
        for i, kind in enumerate(self.kinds):
            if i in master_of:  # step: the master's rounding into the params' buffer
                p = view(master_of[i], "float32")
                out, out_kind = (None, None) if self.emit_u else (view(outs[i], kind), kind)
            elif self.emit_u:
                p, out, out_kind = view(params[i], "float32"), view(outs[i], "float32"), "u"
            else:
                p, out, out_kind = view(outs[i], "float32"), None, None  # aliased to the params
            items.append(ExternalUpdate(p, view(mus[i], "float32"), view(nus[i], "float32"), g[i], kind, out,
                                        out_kind, s[i]))
        self.engine.update_external(items, "cpu")


def _flat_view(buf, kind: str) -> np.ndarray:
    """A flat NumPy view of an XLA:CPU buffer as the kernels read it (uint16 for fp16/bf16)."""
    a = np.asarray(buf).reshape(-1)
    return a.view(np.uint16) if kind != "float32" else a


_PLANS_KEPT = 64
_plans: dict = {}
_plans_lock = threading.Lock()


def _plan(cfg: _Config, kinds, numels, decay, emit_u: bool, platform: str) -> _Plan:
    """The plan of a layout, shared by equal configurations (the most recent ones kept): XLA's compile cache
    keys programs by their callbacks, so a new ``offload_adamw`` or jit of an equal one compiles nothing new."""
    static = tuple(v if _is_number(v) or v is None or isinstance(v, str) else
                   (("callable", v) if callable(v) else "array") for v in cfg)
    key = (static, tuple(kinds), tuple(numels), tuple(decay), emit_u, platform)
    with _plans_lock:
        plan = _plans[key] = _plans.pop(key, None) or _Plan(cfg, kinds, numels, decay, emit_u, platform)  # last: newest
        while len(_plans) > _PLANS_KEPT:
            _plans.pop(next(iter(_plans)))
    return plan


def _cpu_apply(plan: _Plan, scalars, count_inc, g_leaves, p_leaves, mu, nu, masters):
    """``plan``'s update on XLA:CPU: one callback (:meth:`_Plan.__call__`) over one device's leaves."""
    n, sds, f32 = plan.n, jax.ShapeDtypeStruct, jnp.float32
    first = [sds((0,) if k != "float32" else np.shape(p), f32) if plan.emit_u else sds(np.shape(p), p.dtype)
             for p, k in zip(p_leaves, plan.kinds)]
    result = first + [sds(np.shape(p), f32) for p in p_leaves] * 2 + [sds(np.shape(m), f32) for m in masters]
    aliases = {2 + 2 * n + j: n + j for j in range(2 * n + len(masters))}  # the state, from the first moment
    if not plan.emit_u:
        aliases.update({2 + n + i: i for i in range(n)})  # params -> new params, in place
    outs = buffer_callback(plan, result, input_output_aliases=aliases, vmap_method=None)(
        scalars, count_inc, *g_leaves, *p_leaves, *mu, *nu, *masters)
    return outs[:n], outs[n:2 * n], outs[2 * n:3 * n], outs[3 * n:]


class _Impl:
    def __init__(self, cfg: _Config):
        self.cfg = cfg
        self._eager: dict = {}  # emit_u -> the jitted update for calls outside jit
        self._layouts: dict = {}  # _layout_key -> the layout of the last concrete init (None: single-device)

    def _remember_layout(self, params, leaves, paths) -> _sharding.Layout | None:
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            _sharding.check_traced(leaves, paths)  # a traced init of arrays on a mesh
            return None
        self._layouts[_layout_key(params, leaves)] = layout = _sharding.layout_of(leaves, paths)
        return layout

    def init(self, params) -> OffloadAdamWState:
        leaves, paths = jax.tree.leaves(params), _paths(params)
        for x, p in zip(leaves, paths):
            _leaf_dtype_name(x, p)
        platform = _platform_of(leaves)
        _check_gpu_mode(platform, self.cfg)
        _budget.check(self.host_plan(leaves, paths, platform),  # before any array is made
                      "fewer parameters' state per process (shard the parameters over the devices of more "
                      "processes, jax.distributed), or on a GPU mode='gpu' (no staging)")
        layout = self._remember_layout(params, leaves, paths)
        if layout is not None:
            return _sharding.init_state(params, leaves, layout, host_memory=platform == "cuda")
        if platform == "cuda":
            return _gpu.init(params, leaves)
        f32 = lambda x: jnp.zeros(jnp.shape(x), jnp.float32)  # noqa: E731
        master = lambda x: None if np.dtype(x.dtype) == np.float32 else jnp.asarray(x, jnp.float32)  # noqa: E731
        return OffloadAdamWState(jnp.zeros([], jnp.int32), *(jax.tree.map(f, params) for f in (f32, f32, master)))

    def host_plan(self, leaves, paths, platform: str) -> dict[str, float]:
        """:func:`trainstream.core._budget.plan` of the state of ``leaves`` on ``platform``
        (this process's shards; a replicated leaf once per device)."""
        layout = "arrays" if platform != "cuda" else "device" if self.cfg.mode == "gpu" else "staged"
        slots = [(_host_numel(x), _leaf_dtype_name(x, p), layout) for x, p in zip(leaves, paths)]
        return _budget.plan(slots, margin=self.cfg.host_margin)

    def _flatten(self, grads, state, params):
        """The leaves of one update, checked against each other and against the state."""
        if params is None:
            raise ValueError("TrainStream offload_adamw: update needs params (update(grads, state, params))")
        if not isinstance(state, OffloadAdamWState):
            raise TypeError(f"TrainStream offload_adamw: expected an OffloadAdamWState, got {type(state).__name__}")
        p_leaves, p_def = jax.tree.flatten(params)
        g_leaves, g_def = jax.tree.flatten(grads)
        if g_def != p_def:
            raise ValueError(f"TrainStream offload_adamw: gradients and parameters have different pytree "
                             f"structures:\n  grads:  {g_def}\n  params: {p_def}")
        paths = _paths(params)
        mu, nu = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
        master = jax.tree.leaves(state.master, is_leaf=_is_none)
        differs = "TrainStream offload_adamw: the parameter pytree differs from the one passed to init"
        if not (len(mu) == len(nu) == len(master) == len(p_leaves)):
            raise ValueError(f"{differs}: {len(p_leaves)} parameter leaves, the state has {len(mu)} (mu), {len(nu)} "
                             f"(nu), {len(master)} (master)")
        kinds = []
        for i, (g, p, path) in enumerate(zip(g_leaves, p_leaves, paths)):
            kinds.append(_leaf_dtype_name(p, path))
            shape = tuple(np.shape(p))
            if tuple(np.shape(g)) != shape or np.dtype(g.dtype) != np.dtype(p.dtype):
                raise ValueError(f"TrainStream offload_adamw: gradient {path} is {tuple(np.shape(g))} {g.dtype}, "
                                 f"its parameter {shape} {p.dtype}: it must have the parameter's shape and dtype")
            checked = [("mu", mu[i]), ("nu", nu[i])] + ([("master", master[i])] if kinds[i] != "float32" else [])
            for what, a in checked:
                if a is None or tuple(np.shape(a)) != shape or np.dtype(a.dtype) != np.float32:
                    got = None if a is None else (tuple(np.shape(a)), str(a.dtype))
                    raise ValueError(f"{differs}: {what} of leaf {path} is {got}, the parameter {shape} {p.dtype}")
            if kinds[i] == "float32" and master[i] is not None:
                raise ValueError(f"{differs}: leaf {path} is float32 now but has an fp32 master in the state")
        return p_leaves, g_leaves, p_def, paths, kinds, mu, nu, master

    def _apply(self, grads, state, params, emit_u: bool):
        """One traced update: ``(updates or new params, new state)``."""
        from jax._src.interpreters import batching  # noqa: PLC0415
        cfg = self.cfg
        if any(isinstance(x, batching.BatchTracer) for t in (grads, state, params) for x in jax.tree.leaves(t)):
            raise NotImplementedError("TrainStream offload_adamw under jax.vmap: its update has no batching rule; vmap "
                                      "a model's loss, not its optimizer (several models: one optimizer state each)")
        p_leaves, g_leaves, p_def, paths, kinds, mu, nu, master = self._flatten(grads, state, params)
        n, platform = len(p_leaves), _platform_of(p_leaves + g_leaves)
        manual, key = _sharding.in_manual_mesh(), _layout_key(params, p_leaves)  # manual: the arrays are local
        if not manual and key not in self._layouts:
            _sharding.check_traced(p_leaves, paths)
        layout = None if manual else self._layouts.get(key)
        _check_gpu_mode(platform, cfg)
        halves = [i for i, k in enumerate(kinds) if k != "float32"]
        if platform == "cuda":
            _check_host_state(mu, nu, master, paths)  # (_flatten: float32 leaves have no master)
        decay = _resolve_mask(cfg.mask, params, p_def, "mask", True)
        fused = _resolve_mask(cfg.xla_fused_grads, params, p_def, "xla_fused_grads", False)
        if layout is None:
            numels = [math.prod(np.shape(p)) for p in p_leaves]
        else:  # XLA compiles each device's program for its shards: the codes of the local counts
            numels = [math.prod(jax.sharding.NamedSharding(layout.mesh, spec).shard_shape(np.shape(p)))
                      for p, spec in zip(p_leaves, layout.specs)]
            if cfg.convention == "torch" and cfg.max_grad_norm is not None:
                raise NotImplementedError(
                    "TrainStream offload_adamw: convention='torch' with max_grad_norm takes a float64 norm per device, "
                    "not across sharded parameters: use convention='optax' or clip in the program")
        optax_clip = cfg.max_grad_norm is not None and cfg.convention == "optax"
        if cfg.convention == "optax" and platform == "cpu":
            fma, x64 = _xla_cpu_fma(), bool(jax.config.jax_enable_x64)
            if cfg.after_clip is not None:  # the gradients arrive clipped: the pairing is clip's
                codes = [C.optax_cpu_code(n, k, cfg.after_clip, fma=fma, x64=x64) & ~C.OX_CLIP for k in numels]
            else:
                codes = [C.optax_cpu_code(n, k, cfg.max_grad_norm, fused_grad=f, fma=fma, x64=x64)
                         for k, f in zip(numels, fused)]
        else:  # optax/cuda reads only the clip bit; the torch convention none
            codes = [C.OX_CLIP if optax_clip else 0] * n
        # clip_by_global_norm's norm, in the global view (GSPMD partitions it as optax's)
        norm = optax.tree.norm([g.astype(jnp.float32) for g in g_leaves]) if optax_clip else None
        sc = C.optax_scalar_matrix(state.count, codes, decay, learning_rate=cfg.learning_rate, b1=cfg.b1, b2=cfg.b2,
                                   eps=cfg.eps, weight_decay=cfg.weight_decay, global_norm=norm,
                                   max_norm=cfg.max_grad_norm if cfg.convention == "optax" else None, xp=jnp)
        # on the CPU the weights passed in win over a master they no longer match
        masters = [C.master_of_weights(master[i], p_leaves[i], xp=jnp) if platform == "cpu" else master[i]
                   for i in halves]
        u_kernel = emit_u and cfg.convention == "optax"  # the torch convention has no u: new - params
        plan = _plan(cfg, kinds, numels, decay, u_kernel, platform)
        run = functools.partial(_gpu.apply if platform == "cuda" else _cpu_apply, plan)
        if layout is not None:  # each device's callback on its own shards
            placeholder = platform == "cpu" and u_kernel  # update's fp16/bf16 leaves: no first output
            first_specs = [P() if placeholder and i in halves else spec for i, spec in enumerate(layout.specs)]
            run = _sharding.per_device(run, layout, first_specs, halves)
        firsts, mu_new, nu_new, m_new = run(sc.scalars, sc.count_inc, g_leaves, p_leaves, mu, nu, masters)
        m_new = dict(zip(halves, m_new))

        def u_of(i, p):
            if u_kernel and i not in m_new:  # optax's scale_by_learning_rate in the program, written as optax's
                u = firsts[i]  # scale (step_size * u) or scale_by_schedule (step_size an array of u's dtype first)
                return (jnp.array(sc.step_size, dtype=u.dtype) if callable(cfg.learning_rate) else sc.step_size) * u
            # new - params (for a master: apply_updates(p, u) gives its rounding exactly)
            w = m_new[i].astype(p.dtype) if u_kernel and platform == "cpu" else firsts[i]
            return w.astype(jnp.float32) - p.astype(jnp.float32)

        unflatten = functools.partial(jax.tree.unflatten, p_def)
        new_state = OffloadAdamWState(sc.count_inc, unflatten(list(mu_new)), unflatten(list(nu_new)),
                                      unflatten([m_new.get(i) for i in range(n)]))
        return unflatten([u_of(i, p) for i, p in enumerate(p_leaves)] if emit_u else firsts), new_state

    def _run(self, grads, state, params, emit_u: bool):
        if any(isinstance(x, jax.core.Tracer) for t in (grads, state, params) for x in jax.tree.leaves(t)):
            return self._apply(grads, state, params, emit_u)
        # outside jit: a program of its own (op by op, XLA's norm and schedule would round otherwise)
        if params is not None:
            self._remember_layout(params, jax.tree.leaves(params), _paths(params))
        if emit_u not in self._eager:
            self._eager[emit_u] = jax.jit(lambda g, s, p: self._apply(g, s, p, emit_u))
        return self._eager[emit_u](grads, state, params)

    def update(self, updates, state, params=None):
        return self._run(updates, state, params, emit_u=True)


def state_dict(state: OffloadAdamWState, params=None) -> dict:
    """``{"count", "master", "exp_avg", "exp_avg_sq"}`` as NumPy copies, in ``torch.optim.AdamW``'s names; ``master``:
    each leaf's float32 master, for float32 leaves the weights themselves (pass ``params`` if there are any). Whole
    arrays only: the state of several processes (``jax.distributed``) raises ``ValueError``; save it with orbax."""
    for x in jax.tree.leaves(state):
        if not getattr(x, "is_fully_addressable", True):
            raise ValueError("TrainStream state_dict gathers the whole state into this process, and part of it lives "
                             "on other processes' devices (jax.distributed): save the state itself with orbax")
    # copies: a NumPy view of a state array would keep XLA from donating it afterwards
    to_np = lambda x: np.array(jax.device_get(x), copy=True)  # noqa: E731
    masters = jax.tree.leaves(state.master, is_leaf=_is_none)
    if any(m is None for m in masters):
        if params is None:
            raise ValueError("TrainStream state_dict: the float32 leaves are their own master: pass params")
        p_leaves = jax.tree.leaves(params)
        if len(p_leaves) != len(masters):
            raise ValueError(f"TrainStream state_dict: params have {len(p_leaves)} leaves, the state {len(masters)}")
        masters = [p if m is None else m for m, p in zip(masters, p_leaves)]
    masters = [np.array(jax.device_get(m), np.float32, copy=True) for m in masters]
    return {"count": to_np(state.count), "exp_avg": jax.tree.map(to_np, state.mu),
            "exp_avg_sq": jax.tree.map(to_np, state.nu),
            "master": jax.tree.unflatten(jax.tree.structure(state.mu), masters)}


def load_state_dict(state: OffloadAdamWState, sd: dict) -> OffloadAdamWState:
    """The state of a :func:`state_dict` checkpoint, placed like ``state`` (e.g. from ``tx.init``: host memory on
    a GPU); ``ValueError`` where the checkpoint's keys, structure or shapes do not match ``state``. Float32 leaves
    take their weights from the params (restore those too): their ``master`` entries are ignored."""
    missing = {"count", "exp_avg", "exp_avg_sq"} - set(sd)
    if missing:
        raise ValueError(f"TrainStream load_state_dict: checkpoint lacks {sorted(missing)}")
    count = int(np.asarray(sd["count"]))
    if not 0 <= count <= np.iinfo(np.int32).max:
        raise ValueError(f"TrainStream load_state_dict: count {count} out of range")
    like, treedef = jax.tree.flatten(state.mu)
    cols = {}
    for k in ("exp_avg", "exp_avg_sq") + (("master",) if "master" in sd else ()):
        leaves, td = jax.tree.flatten(sd[k])
        if td != treedef:
            raise ValueError(f"TrainStream load_state_dict: checkpoint {k!r} has pytree structure {td}, the "
                             f"optimizer was initialised for {treedef}")
        for i, a in enumerate(leaves):
            if tuple(np.shape(a)) != tuple(np.shape(like[i])):
                raise ValueError(f"TrainStream load_state_dict: checkpoint {k!r} leaf {i} has shape "
                                 f"{tuple(np.shape(a))}, the parameter has {tuple(np.shape(like[i]))}")
        cols[k] = leaves

    def put(a, ref, dtype=np.float32):
        a = np.asarray(a, dtype)
        sh = getattr(ref, "sharding", None)
        return jax.device_put(a, sh) if sh is not None else jnp.asarray(a)

    old_m = jax.tree.leaves(state.master, is_leaf=_is_none)
    if any(m is not None for m in old_m) and "master" not in cols:
        raise ValueError("TrainStream load_state_dict: checkpoint lacks 'master' (fp16/bf16 leaves)")
    mu = [put(a, r) for a, r in zip(cols["exp_avg"], like)]
    nu = [put(a, r) for a, r in zip(cols["exp_avg_sq"], jax.tree.leaves(state.nu))]
    master = [None if m is None else put(cols["master"][i], m) for i, m in enumerate(old_m)]
    return OffloadAdamWState(put(count, state.count, np.int32), jax.tree.unflatten(treedef, mu),
                             jax.tree.unflatten(treedef, nu), jax.tree.unflatten(treedef, master))


def close(state: OffloadAdamWState) -> None:
    """Release the state's memory now (host memory on a GPU) instead of when its arrays are collected: every array
    of ``state`` is deleted and the state unusable. Idempotent. (The process's host workers stay.)"""
    for x in jax.tree.leaves(state):
        delete = getattr(x, "delete", None)
        if delete is not None and not (hasattr(x, "is_deleted") and x.is_deleted()):
            delete()


class OffloadAdamW(optax.GradientTransformation):
    """The :class:`optax.GradientTransformation` returned by :func:`offload_adamw`: ``init`` and ``update`` as
    optax.adamw's (params required), plus :meth:`step`, :meth:`host_memory_plan` and the module functions
    :func:`state_dict`, :func:`load_state_dict` and :func:`close` as static methods."""

    __slots__ = ()

    def host_memory_plan(self, params) -> dict[str, float]:
        """The host memory ``init(params)`` will check and its state take, allocating nothing: bytes per part, pinned
        and pageable, ``needed``, ``available``, ``usable``, ``fits`` (:func:`trainstream.core._budget.plan`)."""
        leaves = jax.tree.leaves(params)
        return self.init.__self__.host_plan(leaves, _paths(params), _platform_of(leaves))

    def step(self, grads, state, params):
        """One update: ``(new_params, new_state)``, the new weights in one pass (no update array), written in
        place where the caller donates the params."""
        return self.update.__self__._run(grads, state, params, emit_u=False)

    state_dict = staticmethod(state_dict)
    load_state_dict = staticmethod(load_state_dict)
    close = staticmethod(close)


def _static(name: str, x, default, positive: bool = True):
    """An argument that changes no bit: an int checked here, or ``host_margin`` (checked by ``_budget.plan``).
    optax.inject_hyperparams passes every number as an array too (a tracer in the update): a traced one falls back
    to its default (name it in static_args to keep another)."""
    if isinstance(x, jax.core.Tracer):
        x = default
    elif hasattr(x, "dtype") and np.ndim(x) == 0:
        x = x.item()
    if name == "host_margin" or (x is None and default is None):  # threads None: decided at the first update
        return x
    if isinstance(x, bool) or not isinstance(x, int) or (positive and x < 1):
        what = "a positive int" if positive else "an int"
        raise ValueError(f"{name} must be {what}{' or None' if default is None else ''}, got {x!r}")
    return x


def offload_adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 1e-4, *, max_grad_norm: float | None = None, mask: Any = None,
                  xla_fused_grads: Any = None, after_clip_by_global_norm: float | None = None, mode: str = "cpu",
                  convention: str = "optax", threads: int | None = None, chunk_size: int = 1 << 20,
                  worker_nice: int = 5, host_margin: float | None = _budget.MARGIN,
                  gpu_state_bytes: int | None = None) -> OffloadAdamW:
    """``optax.adamw`` with its state (fp32 moments, fp32 masters of fp16/bf16 weights) in host memory, updated
    on the host (Numba kernels) or, on a GPU, by a CUDA kernel. The arithmetic: "optax" in :mod:`trainstream.contract`.

    Args:
      learning_rate: a float, an optax schedule (``count -> lr``) or an array (``optax.inject_hyperparams``).
      b1, b2, eps, weight_decay: as ``optax.adamw`` (``eps_root`` = 0, no Nesterov); floats or arrays.
      max_grad_norm: if given, ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(...))``
        (optax's norm of the float32-upcast gradients, in the program); ``convention="torch"``: ``clip_grad_norm_``'s
        coefficient of a float64 norm (not for sharded parameters). Hazard: over several processes on an AVX2 host
        1 weight in 190 was 1 ULP off after 3 steps (XLA:CPU rounded a small matmul's gradient otherwise for our
        callback than in optax's program); ``optax.chain(optax.clip_by_global_norm(M), offload_adamw(...,
        after_clip_by_global_norm=M))`` (optax's clip consumes the gradient first, as in optax's program) stayed
        bit-identical there.
      mask: as ``optax.adamw``'s (leaves with False get no weight decay).
      xla_fused_grads: like ``mask``: True for the leaves whose gradient XLA:CPU fuses into optax's moment update
        in the reference program ("Fused gradients" in the contract), e.g. every leaf under ``optax.MultiSteps``.
        Default: none. XLA:CPU only.
      after_clip_by_global_norm: ``M`` when this follows ``optax.clip_by_global_norm(M)`` in an ``optax.chain``
        on XLA:CPU (``max_grad_norm=M``'s FMA pairing; ``max_grad_norm=M`` is the simpler way to write that chain);
        excludes ``max_grad_norm``.
      mode: ``"cpu"``: the host updates (on a GPU: gradients to the host, weights back, on XLA's stream). ``"gpu"``:
        a CUDA kernel on XLA's stream, the state in pinned host memory streamed through a 72 MiB ring of GPU buffers
        per device, kept for the process; needs the parameters on a CUDA device and ``convention="optax"``.
      convention: ``"optax"`` (optax.adamw as XLA compiles it) or ``"torch"`` (``torch.optim.AdamW`` on the
        CPU, bit for bit; needs torch and float hyper-parameters; ``update`` returns ``new - params``).
      threads, chunk_size: host worker threads of this process, shared by its devices (default: its share of
        the usable cores among this host's JAX processes, less one), and the elements of one job.
      worker_nice: the host workers' nice value (Linux applies it per thread).
      host_margin: ``init`` first checks the host memory the state (on a GPU in ``mode="cpu"`` also the pinned
        staging) will take (:meth:`OffloadAdamW.host_memory_plan`) against what the host has less this
        fraction, raising ``MemoryError`` before any array is made. None: no check.
      gpu_state_bytes: not built for JAX: anything but None or 0 raises ``NotImplementedError``; for state in GPU
        memory give those leaves ``optax.adamw`` (``optax.multi_transform``; float32 leaves: ``mode="gpu"``'s bits).

    Bad arguments raise ``ValueError`` or ``TypeError``, unsupported uses (e.g. ``jax.vmap``) ``NotImplementedError``.

    Exactness: on the CPU backend (jitted or eager) ``update`` returns optax.adamw's update bits (so ``apply_updates``
    and optax's wrappers give the reference program's), ``step`` the same new weights directly. An fp16/bf16 leaf's
    fp32 master is optax's on fp32 parameters fed the upcast gradients, the weights its rounding (``update`` returns
    the float32 difference ``apply_updates`` turns into it); on the CPU a master that does not round to the weights
    passed in is replaced by them (:func:`trainstream.contract.master_of_weights`), on a GPU used as it is. On a GPU
    ``mode="gpu"`` gives optax's bits, ``mode="cpu"`` the same formula in IEEE arithmetic on the host, within the
    contract's ``OPTAX_CUDA_HOST_MAX_ULP``.

    Donation: donate the state (``jax.jit(..., donate_argnums=...)``) to update it in place, else XLA copies it
    first; then pass and return params and state in the same order (``step(params, state, ...) -> (params,
    state)``): JAX pairs donated uncommitted inputs with outputs by shape and dtype alone, and could pair a moment
    in host memory with a weight in GPU memory. On a GPU a NumPy view of a state array blocks its donation: copy it.

    Sharded parameters (``NamedSharding`` over any mesh, one process or ``jax.distributed``): call ``init`` outside jit
    (it reads the specs from the concrete arrays); each device updates its own shards with the whole program's
    scalars and global norm, as optax.adamw does; inside the caller's own ``shard_map``, as optax's, that device's.
    """
    if mode not in ("cpu", "gpu"):
        raise ValueError(f"mode must be 'cpu' or 'gpu', got {mode!r}")
    if gpu_state_bytes not in (None, 0):
        raise NotImplementedError(
            f"TrainStream offload_adamw(gpu_state_bytes={gpu_state_bytes!r}) is not built for JAX (XLA refuses one "
            "custom call whose outputs mix host and GPU memory): give the leaves whose state stays in GPU memory "
            "optax.adamw (optax.multi_transform; float32 leaves get mode='gpu''s bits), the rest offload_adamw")
    if convention not in C.CONVENTIONS:
        raise ValueError(f"Unknown convention {convention!r}; expected one of {C.CONVENTIONS}")
    hyper = dict(lr=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if all(_is_number(v) or (k == "lr" and callable(v)) for k, v in hyper.items()):
        C.validate_hyperparams(0.0 if callable(learning_rate) else learning_rate, (b1, b2), eps, weight_decay)
    elif convention == "torch":
        raise NotImplementedError("TrainStream offload_adamw: convention='torch' computes its scalars on the host from "
                                  "Python floats; array hyper-parameters (inject_hyperparams) need convention='optax'")
    else:
        for k, v in hyper.items():
            if not (_is_number(v) or callable(v) or hasattr(v, "dtype")):
                raise TypeError(f"TrainStream offload_adamw: {k} must be a float or an array, got {type(v).__name__}")
    if max_grad_norm is not None:
        if not _is_number(max_grad_norm):
            raise TypeError(f"max_grad_norm must be a float, got {type(max_grad_norm).__name__}")
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite float, got {max_grad_norm}")
    after_clip = after_clip_by_global_norm
    if after_clip is not None and not (_is_number(after_clip) and after_clip > 0):
        raise ValueError(f"after_clip_by_global_norm must be a positive float, got {after_clip!r}")
    if after_clip is not None and max_grad_norm is not None:
        raise ValueError("after_clip_by_global_norm (a clip before this in a chain) excludes max_grad_norm")
    threads = _static("threads", threads, None)
    chunk_size = _static("chunk_size", chunk_size, 1 << 20)
    worker_nice = _static("worker_nice", worker_nice, 5, positive=False)
    host_margin = _static("host_margin", host_margin, _budget.MARGIN)
    if convention == "torch":
        _torch_cpu_code()  # refuse early without torch
    _budget.plan([], margin=host_margin)  # a bad margin raises here
    fl = lambda x: float(x) if _is_number(x) else x  # noqa: E731
    impl = _Impl(_Config(*map(fl, (learning_rate, b1, b2, eps, weight_decay, max_grad_norm)), mask, xla_fused_grads,
                         fl(after_clip), mode, convention, threads, chunk_size, worker_nice, host_margin))
    return OffloadAdamW(impl.init, impl.update)
