"""JAX adapter: ``offload_adamw`` and ``offload_adam``, optax.adamw and optax.adam (their signatures) whose state
lives in host memory, and their :class:`OffloadTransformation` (the checked arguments: :mod:`._config`).

No arithmetic lives here: the per-step scalars are :func:`trainstream.contract.optax_scalar_matrix` in ``jax.numpy``
in the user's program (only XLA reproduces XLA's bias corrections, schedule and global norm); the update is a contract
kernel on XLA's buffers through ``buffer_callback``, run by the engine's placements (:mod:`trainstream.core`; XLA:CPU:
:mod:`._plan`, XLA:GPU: :mod:`._gpu`; meshes: :mod:`._sharding`; the state: :mod:`._state`; part of it kept in device
memory, ``gpu_state_bytes``: :mod:`._resident`). The callbacks are pure:
the state goes in aliased to the outputs (in place where donated), nothing kept between calls.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from .. import contract as C
from ..backends import jax as xb
from ..core import _budget, host_ring_bytes
from . import _detect, _gpu, _plan, _resident, _sharding
from ._config import (Config, Family, check_array_hyper, cuda_codes, family, leaf_dtype_name, mu_dtype_name,
                      static_arg, warn_cpu_mode_on_gpu)
from ._leaves import check_gpu_mode as _check_gpu_mode
from ._leaves import layout_key as _layout_key
from ._leaves import paths as _paths
from ._leaves import platform_of as _platform_of
from ._leaves import resolve_mask as _resolve_mask
from ._plan import is_number as _is_number
from ._state import OffloadAdamWState, close, is_none, load_state_dict, state_dict

__all__ = ["OffloadTransformation", "offload_adam", "offload_adamw"]


def _host_numel(x) -> int:
    """Elements of leaf ``x`` whose state this process holds (its devices' shards)."""
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if sharding is None:
        return math.prod(np.shape(x))
    return len(sharding.addressable_devices) * math.prod(sharding.shard_shape(np.shape(x)))


def _device_numels(leaves) -> list[list[int]]:
    """Per device of this process, the elements of each leaf's shard there (one device where the arrays have no
    sharding: tracers)."""
    per: dict = {}
    for x in leaves:
        sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
        if sharding is None:
            per.setdefault(None, []).append(math.prod(np.shape(x)))
            continue
        n = math.prod(sharding.shard_shape(np.shape(x)))
        for d in sharding.addressable_devices:
            per.setdefault(d, []).append(n)
    return list(per.values())


def _check_host_state(mu, nu, master, paths) -> None:
    """On a GPU the moments and masters must arrive in host memory (else the state would silently live on the GPU)."""
    for what, leaves in (("mu", mu), ("nu", nu), ("master", master)):
        for x, path in zip(leaves, paths):
            if x is not None and getattr(jax.typeof(x), "memory_space", None) != jax.memory.Space.Host:
                raise ValueError(
                    f"TrainStream offload_adamw: the state's {what} of leaf {path} is {jax.typeof(x)} in GPU memory, "
                    "not in pinned host memory as tx.init places it: pass the state from init or update, or restore "
                    "to tx.init(params)'s shardings (orbax: jax.tree.map(ocp.utils.to_shape_dtype_struct, state))")


class _Impl:
    def __init__(self, cfg: Config):
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
        fams = [family(self.cfg, leaf_dtype_name(x, p), p) for x, p in zip(leaves, paths)]
        platform = _platform_of(leaves)
        _check_gpu_mode(platform, self.cfg)
        if platform == "cuda":
            cuda_codes(self.cfg, [leaf_dtype_name(x, p) for x, p in zip(leaves, paths)], fams, paths,
                       [math.prod(np.shape(x)) for x in leaves])
            if self.cfg.mode == "cpu":
                warn_cpu_mode_on_gpu()
        _budget.check(self.host_plan(leaves, paths, platform),  # before any array is made
                      "fewer parameters' state per process (shard the parameters over the devices of more "
                      "processes, jax.distributed), or on a GPU mode='gpu' (no staging)")
        layout = self._remember_layout(params, leaves, paths)
        if layout is not None:
            return _sharding.init_state(params, leaves, layout, host_memory=platform == "cuda", families=fams)
        if platform == "cuda":
            return _gpu.init(params, leaves, fams)
        treedef = jax.tree.structure(params)
        col = lambda f: jax.tree.unflatten(treedef, [f(x, fam) for x, fam in zip(leaves, fams)])  # noqa: E731
        return OffloadAdamWState(jnp.zeros([], jnp.int32), col(lambda x, f: jnp.zeros(jnp.shape(x), f.mu)),
                                 col(lambda x, f: jnp.zeros(jnp.shape(x), f.nu)),
                                 col(lambda x, f: jnp.asarray(x, jnp.float32) if f.master else None))

    def host_plan(self, leaves, paths, platform: str) -> dict[str, float]:
        """:func:`trainstream.core._budget.plan` of the state of ``leaves`` on ``platform``
        (this process's shards; a replicated leaf once per device)."""
        layout = "arrays" if platform != "cuda" else "device" if self.cfg.mode == "gpu" else "staged"
        slots = []
        for x, p in zip(leaves, paths):  # (upper bound)
            dtype = leaf_dtype_name(x, p)
            f = family(self.cfg, dtype, p)
            slots.append((_host_numel(x), dtype, layout, (f.mu, f.nu, f.master)))
        ring = sum(host_ring_bytes(n) for n in _device_numels(leaves)) if layout == "staged" else 0  # per device
        return _budget.plan(slots, margin=self.cfg.host_margin, ring_bytes=ring)

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
        master = jax.tree.leaves(state.master, is_leaf=is_none)
        differs = "TrainStream offload_adamw: the parameter pytree differs from the one passed to init"
        if not (len(mu) == len(nu) == len(master) == len(p_leaves)):
            raise ValueError(f"{differs}: {len(p_leaves)} parameter leaves, the state has {len(mu)} (mu), {len(nu)} "
                             f"(nu), {len(master)} (master)")
        for what, part in (("mu", state.mu), ("nu", state.nu)):  # as optax's tree.map(updates, mu) requires
            if (s_def := jax.tree.structure(part)) != p_def:
                raise ValueError(f"{differs}: the state's {what} is a tree of another structure:\n  {what}:     "
                                 f"{s_def}\n  params: {p_def}")
        kinds, fams = [], []
        for i, (g, p, path) in enumerate(zip(g_leaves, p_leaves, paths)):
            kinds.append(leaf_dtype_name(p, path))
            fams.append(fam := family(self.cfg, kinds[i], path))
            shape = tuple(np.shape(p))
            if tuple(np.shape(g)) != shape or np.dtype(g.dtype) != np.dtype(p.dtype):
                raise ValueError(f"TrainStream offload_adamw: gradient {path} is {tuple(np.shape(g))} {g.dtype}, "
                                 f"its parameter {shape} {p.dtype}: it must have the parameter's shape and dtype")
            checked = [("mu", mu[i], fam.mu), ("nu", nu[i], fam.nu)] + ([("master", master[i], "float32")]
                                                                         if fam.master else [])
            for what, a, want in checked:
                if a is None or tuple(np.shape(a)) != shape or np.dtype(a.dtype) != jnp.dtype(want):
                    got = None if a is None else (tuple(np.shape(a)), str(a.dtype))
                    raise ValueError(f"{differs}: {what} of leaf {path} is {got}, expected {shape} {want} for the "
                                     f"parameter {p.dtype} (mu_dtype={self.cfg.mu_dtype}, master_weights="
                                     f"{self.cfg.master_weights})")
            if not fam.master and master[i] is not None:
                raise ValueError(f"{differs}: leaf {path} ({kinds[i]}, master_weights={self.cfg.master_weights}) has "
                                 "an fp32 master in the state")
        return p_leaves, g_leaves, p_def, paths, kinds, fams, mu, nu, master

    def _code(self, n: int, numel: int, kind: str, fam: Family, path: str, ndim: int) -> int:
        """The optax/cpu code of one leaf (:func:`trainstream.contract.optax_cpu_code`) with the default pairing of
        a materialised gradient; :func:`._detect.fused_codes` then sets the pairing bits XLA:CPU gives the program."""
        cfg = self.cfg
        num = lambda x: float(x) if _is_number(x) else None  # noqa: E731 (an array: XLA folds nothing)
        half = kind != "float32" and not fam.master
        if half and cfg.max_grad_norm is not None:
            raise NotImplementedError(f"TrainStream offload_adamw: max_grad_norm with the {kind} leaf {path}'s state "
                                      f"in {fam.mu}/{fam.nu}: no host lines yet for optax's clip there (chain "
                                      "optax.clip_by_global_norm before offload_adamw, or master_weights=True)")
        try:
            code = C.optax_cpu_code(n, numel, None if half else cfg.max_grad_norm, fma=xb.xla_cpu_fma(),
                                    x64=bool(jax.config.jax_enable_x64), dtype=kind,
                                    mu_dtype=None if fam.master else fam.mu, master=fam.master,
                                    nesterov=cfg.nesterov, b1=num(cfg.b1), b2=num(cfg.b2), eps=num(cfg.eps),
                                    ndim=ndim)
        except ValueError as exc:  # the contract has no lines for it
            raise NotImplementedError(f"TrainStream offload_adamw: leaf {path}: {exc}") from None
        if not C.optax_code_valid(code):
            raise NotImplementedError(f"TrainStream offload_adamw: no host lines for leaf {path} ({kind}) in this "
                                      f"configuration (optax/cpu code {code}: nesterov={cfg.nesterov} with eps == 0 "
                                      "or b1/b2 == 0.5 in a mixed mu_dtype, whose FMA pairing XLA varies)")
        return code

    def _apply(self, grads, state, params, emit_u: bool, decay=None, norm=None, n_tree=None):
        """One traced update: ``(updates or new params, new state)``. Where these leaves are part of a tree of
        ``n_tree`` leaves (:mod:`._resident`): ``decay`` (the mask per leaf) and ``norm`` (clip_by_global_norm's)."""
        from jax._src.interpreters import batching  # noqa: PLC0415
        cfg = self.cfg
        if any(isinstance(x, batching.BatchTracer) for t in (grads, state, params) for x in jax.tree.leaves(t)):
            raise NotImplementedError("TrainStream offload_adamw under jax.vmap: its update has no batching rule; vmap "
                                      "a model's loss, not its optimizer (several models: one optimizer state each)")
        p_leaves, g_leaves, p_def, paths, kinds, fams, mu, nu, master = self._flatten(grads, state, params)
        n, platform = len(p_leaves), _platform_of(p_leaves + g_leaves)
        manual, key = _sharding.in_manual_mesh(), _layout_key(params, p_leaves)  # manual: the arrays are local
        if not manual and key not in self._layouts:
            _sharding.check_traced(p_leaves, paths)
        layout = None if manual else self._layouts.get(key)
        _check_gpu_mode(platform, cfg)
        halves = [i for i, f in enumerate(fams) if f.master]  # the leaves with an fp32 master
        check_array_hyper(cfg, kinds, fams, paths)
        if platform == "cuda":
            _check_host_state(mu, nu, master, paths)  # (_flatten: float32 leaves have no master)
        decay = _resolve_mask(cfg.mask, params, p_def, "mask", True) if decay is None else decay
        if layout is None:
            numels = [math.prod(np.shape(p)) for p in p_leaves]
        else:  # XLA compiles each device's program for its shards: the codes of the local counts
            numels = [math.prod(jax.sharding.NamedSharding(layout.mesh, spec).shard_shape(np.shape(p)))
                      for p, spec in zip(p_leaves, layout.specs)]
        optax_clip = cfg.max_grad_norm is not None
        if platform == "cuda":  # XLA:GPU's lines of each leaf, by its elements on the device
            codes = cuda_codes(cfg, kinds, fams, paths, numels)
        else:
            codes = [self._code(n_tree or n, k, kind, fam, path, np.ndim(p))
                     for k, kind, fam, path, p in zip(numels, kinds, fams, paths, p_leaves)]
            # the pairing bits XLA:CPU gives optax's moment lines in this program (the family bits stay)
            codes = _detect.fused_codes(codes, g_leaves, p_leaves, decay, cfg, kinds, [f.master for f in fams],
                                        n_tree)
            _detect.warn_output_pairing(codes, decay, cfg.weight_decay)
        # clip_by_global_norm's norm, in the global view (GSPMD partitions it as optax's)
        if optax_clip and norm is None:
            norm = optax.tree.norm([g.astype(jnp.float32) for g in g_leaves])
        sc = C.optax_scalar_matrix(state.count, codes, decay, learning_rate=cfg.learning_rate, b1=cfg.b1, b2=cfg.b2,
                                   eps=cfg.eps, weight_decay=cfg.weight_decay, global_norm=norm,
                                   max_norm=cfg.max_grad_norm, xp=jnp, eps_root=cfg.eps_root, dtypes=kinds,
                                   platform=platform)
        # on the CPU the weights passed in win over a master they no longer match
        masters = [C.master_of_weights(master[i], p_leaves[i], xp=jnp) if platform == "cpu" else master[i]
                   for i in halves]
        plan = _plan.plan_for(cfg, kinds, numels, emit_u, platform, fams)
        run = functools.partial(_gpu.apply if platform == "cuda" else _plan.cpu_apply, plan)
        if layout is not None:  # each device's callback on its own shards
            placeholder = platform == "cpu" and emit_u  # update's fp16/bf16 leaves: no first output
            first_specs = [P() if placeholder and i in halves else spec for i, spec in enumerate(layout.specs)]
            run = _sharding.per_device(run, layout, first_specs, halves)
        firsts, mu_new, nu_new, m_new = run(sc.scalars, sc.count_inc, g_leaves, p_leaves, mu, nu, masters)
        m_new = dict(zip(halves, m_new))

        def u_of(i, p):
            if emit_u and i not in m_new:  # optax's scale_by_learning_rate in the program, written as optax's
                u = firsts[i]  # scale (step_size * u) or scale_by_schedule (step_size an array of u's dtype first)
                return (jnp.array(sc.step_size, dtype=u.dtype) if callable(cfg.learning_rate) else sc.step_size) * u
            # new - params (for a master: apply_updates(p, u) gives its rounding exactly)
            w = m_new[i].astype(p.dtype) if emit_u and platform == "cpu" else firsts[i]
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

    def update(self, updates, state, params=None, **extra_args):
        """optax's ``update``; ``extra_args`` (optax's extra-arguments protocol) are ignored, as optax.adamw's."""
        del extra_args
        return self._run(updates, state, params, emit_u=True)


class OffloadTransformation(optax.GradientTransformationExtraArgs):
    """The :class:`optax.GradientTransformationExtraArgs` returned by :func:`offload_adamw` and :func:`offload_adam`:
    ``init`` and ``update`` as optax.adamw's (params required; extra keyword arguments ignored), plus :meth:`step`,
    :meth:`host_memory_plan` and the module functions :func:`state_dict`, :func:`load_state_dict` and :func:`close`
    as static methods."""

    __slots__ = ()

    def host_memory_plan(self, params) -> dict[str, float]:
        """The host memory ``init(params)`` will check and its state take, allocating nothing: bytes per part, pinned
        and pageable, ``needed``, ``available``, ``usable``, ``fits`` (:func:`trainstream.core._budget.plan`), and
        the state kept in device memory (``gpu_state_bytes``: bytes per device, ``gpu_state_leaves``)."""
        leaves = jax.tree.leaves(params)
        plan = self.init.__self__.host_plan(leaves, _paths(params), _platform_of(leaves))
        return {"gpu_state_bytes": 0.0, "gpu_state_leaves": 0.0, **plan}

    def step(self, grads, state, params):
        """One update: ``(new_params, new_state)``, the new weights in one pass (no update array), written in
        place where the caller donates the params."""
        return self.update.__self__._run(grads, state, params, emit_u=False)

    state_dict = staticmethod(state_dict)
    load_state_dict = staticmethod(load_state_dict)
    close = staticmethod(close)


def offload_adamw(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, mu_dtype: Any = None, weight_decay: float | Callable = 1e-4, mask: Any = None,
                  *, nesterov: bool = False, master_weights: bool = False, max_grad_norm: float | None = None,
                  mode: str = "cpu", gpu_state_bytes: int | str | None = None, threads: int | None = None,
                  worker_nice: int = 5, host_margin: float | None = _budget.MARGIN) -> OffloadTransformation:
    """``optax.adamw`` (its signature, in its order) with its state in host memory, updated on the host (Numba
    kernels) or, on a GPU, by a CUDA kernel. The arithmetic: "optax" in :mod:`trainstream.contract`.

    Args:
      learning_rate: a float, an optax schedule (``count -> lr``) or an array (``optax.inject_hyperparams``).
      b1, b2, eps, eps_root, weight_decay (a float or a schedule), mask, nesterov: as ``optax.adamw``'s; floats or
        arrays.
      mu_dtype: as ``optax.adamw``'s: mu's dtype (None: the leaf's). The state is optax's: nu in the leaf's dtype,
        mu in ``mu_dtype``, so an fp16/bf16 leaf keeps fp16/bf16 moments and no master (optax's default).
      master_weights: fp16/bf16 leaves keep a float32 master and float32 moments instead (the PyTorch adapter's
        ``master_weights=True``): optax.adamw on float32 parameters fed the upcast gradients (materialised: the
        default FMA pairing, not read from the program), the weights its rounding; ``mu_dtype`` None or float32.
      max_grad_norm: if given, ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(...))``
        (optax's norm of the float32-upcast gradients, in the program). Hazard: over several processes on an AVX2 host
        1 weight in 190 was 1 ULP off after 3 steps (XLA:CPU rounded a small matmul's gradient otherwise for our
        callback than in optax's program); ``optax.chain(optax.clip_by_global_norm(M), offload_adamw(...))``
        (optax's clip consumes the gradient first, as in optax's program) stayed bit-identical there.
      mode: ``"cpu"``: the host updates (on a GPU: gradients to the host, weights back, piece by piece through a ring
        of at most 8 pinned buffers of 48 MiB per device, kept for the process). ``"gpu"``:
        a CUDA kernel on XLA's stream, the state in pinned host memory streamed through a 72 MiB ring of GPU buffers
        per device, kept for the process; needs the parameters on a CUDA device.
      gpu_state_bytes: None or 0: all the state in host memory. Bytes per device: the leaves whose state fits, in
        tree order (first fit; never one leaf alone in a tree of several), keep it in device memory and are updated
        by optax.adamw's own transformation (:mod:`._resident`); ``"auto"``: what the devices' allocator has free
        at ``init`` (``memory_stats()``), less a tenth. With ``optax.inject_hyperparams``: name it in static_args.
      threads: host worker threads of this process, shared by its devices (default: its share of the usable cores
        among this host's JAX processes, less one).
      worker_nice: the host workers' nice value (Linux applies it per thread).
      host_margin: ``init`` first checks the host memory the state (on a GPU in ``mode="cpu"`` also the staging
        ring) will take (:meth:`OffloadTransformation.host_memory_plan`) against what the host has less this
        fraction, raising ``MemoryError`` before any array is made. None: no check.

    Not reproduced (``NotImplementedError`` saying which and why): float64 and complex leaves; ``mu_dtype`` other
    than the leaf's, float32 or (float32 leaves) bfloat16; ``max_grad_norm`` with fp16/bf16 state; on a GPU the
    configurations whose XLA:GPU lines are not derived (:func:`trainstream.contract.optax_cuda_code`: e.g. fp16 state
    with an ``eps`` that float16 keeps, ``mu_dtype`` with ``nesterov``), in either mode.

    Bad arguments raise ``ValueError`` or ``TypeError``, unsupported uses (e.g. ``jax.vmap``) ``NotImplementedError``.

    Exactness: on the CPU backend (jitted or eager) ``update`` returns optax.adamw's update bits in optax's dtype (so
    ``apply_updates`` and optax's wrappers give the reference program's), ``step`` the same new weights directly, for
    float32, float16 and bfloat16 leaves and every argument above (the state in optax's dtypes, the contract's
    optax/cpu families). With ``master_weights=True`` an fp16/bf16 leaf's fp32 master is optax's on fp32 parameters
    fed the upcast gradients, the weights its rounding (``update`` returns
    the float32 difference ``apply_updates`` turns into it); on the CPU a master that does not round to the weights
    passed in is replaced by them (:func:`trainstream.contract.master_of_weights`), on a GPU used as it is. On a GPU
    ``mode="gpu"`` gives optax's bits, ``mode="cpu"`` the same lines in IEEE arithmetic on the host, within the
    contract's ``OPTAX_CUDA_HOST_MAX_ULP`` (warned once).

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
    hyper = dict(lr=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
    if all(_is_number(v) or (k in ("lr", "weight_decay") and callable(v)) for k, v in hyper.items()):
        C.validate_hyperparams(0.0 if callable(learning_rate) else learning_rate, (b1, b2), eps,
                               0.0 if callable(weight_decay) else weight_decay)
        if not (eps_root >= 0 and math.isfinite(eps_root)):
            raise ValueError(f"eps_root must be a finite float >= 0, got {eps_root}")
    else:
        for k, v in hyper.items():
            if not (_is_number(v) or callable(v) or hasattr(v, "dtype")):
                raise TypeError(f"TrainStream offload_adamw: {k} must be a float or an array, got {type(v).__name__}")
    mu_name = mu_dtype_name(mu_dtype)
    for name, flag in (("nesterov", nesterov), ("master_weights", master_weights)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"TrainStream offload_adamw: {name} must be a bool, got {type(flag).__name__}")
    if max_grad_norm is not None:
        if not _is_number(max_grad_norm):
            raise TypeError(f"max_grad_norm must be a float, got {type(max_grad_norm).__name__}")
        if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite float, got {max_grad_norm}")
    threads = static_arg("threads", threads, None)
    worker_nice = static_arg("worker_nice", worker_nice, 5, positive=False)
    host_margin = static_arg("host_margin", host_margin, _budget.MARGIN)
    _budget.plan([], margin=host_margin)  # a bad margin raises here
    fl = lambda x: float(x) if _is_number(x) else x  # noqa: E731
    budget = _resident.check_budget(gpu_state_bytes)
    impl = _Impl(Config(*map(fl, (learning_rate, b1, b2, eps, eps_root)), mu_name, fl(weight_decay), mask,
                        bool(nesterov), fl(max_grad_norm), bool(master_weights), mode, threads, worker_nice,
                        host_margin))
    if budget:  # None or 0: all the state in host memory
        impl = _resident.Resident(impl, budget)
    return OffloadTransformation(impl.init, impl.update)


def offload_adam(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                 eps_root: float = 0.0, mu_dtype: Any = None, *, nesterov: bool = False, master_weights: bool = False,
                 max_grad_norm: float | None = None, mode: str = "cpu", gpu_state_bytes: int | str | None = None,
                 threads: int | None = None, worker_nice: int = 5,
                 host_margin: float | None = _budget.MARGIN) -> OffloadTransformation:
    """``optax.adam`` (its signature, in its order) with its state in host memory: :func:`offload_adamw` without
    weight decay (optax.adam's bits: ``add_decayed_weights`` of 0 adds nothing), the same keyword-only options."""
    return offload_adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, 0.0, None, nesterov=nesterov,
                         master_weights=master_weights, max_grad_norm=max_grad_norm, mode=mode,
                         gpu_state_bytes=gpu_state_bytes, threads=threads, worker_nice=worker_nice,
                         host_margin=host_margin)
