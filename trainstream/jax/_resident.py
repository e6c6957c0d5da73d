"""State kept in device memory for the JAX adapter: ``offload_adamw(..., gpu_state_bytes=N or "auto")``.

XLA refuses one custom call whose outputs mix host and GPU memory, so the split is two transformations over a
partition of the leaves, inside one ``init`` and one ``update``:

* the leaves whose state fits the budget (:func:`resident`: in tree order, first fit, the rule of the torch adapter's
  ``gpu_state_bytes``) keep it in device memory and are updated by ``optax.adamw``'s own transformation, so their bits
  are optax's by construction (no arithmetic here; a chained ``clip_by_global_norm`` is optax's over the whole tree);
* the others go through the host path (``trainstream.jax._transform._Impl``), given the whole tree's mask and
  global norm.

The state stays one :class:`OffloadAdamWState` over the whole tree (each leaf's moments where its part keeps them),
so optax's wrappers, nnx and orbax take it as before. Each part sees the tree with the other part's leaves replaced
by ``()`` (an empty node), so the paths in its messages are the user's. On a GPU ``update`` reads the split from the
state (the leaves whose moments are in device memory); on the CPU, where all of it is host memory, from ``init``'s
split of the same layout, else from the rule.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.buffer_callback import buffer_callback

from .. import contract as C
from ..core import _budget
from ._config import family, leaf_dtype_name
from ._leaves import check_gpu_mode, layout_key, paths, platform_of, resolve_mask
from ._state import OffloadAdamWState, is_none

__all__ = ["AUTO_GPU_HEADROOM", "Resident", "auto_budget", "check_budget", "resident", "state_bytes"]

#: ``gpu_state_bytes="auto"`` leaves this fraction of the device's memory (XLA's ``bytes_limit``) free, as the torch
#: adapter's ``AUTO_GPU_HEADROOM``.
AUTO_GPU_HEADROOM = 0.1
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_HINT = ("a larger gpu_state_bytes (more state in device memory), fewer parameters' state per process (shard the "
         "parameters over the devices of more processes), or on a GPU mode='gpu' (no staging)")


def check_budget(x):
    """``gpu_state_bytes`` checked: None or 0 (no state in device memory), a positive int, or ``"auto"``. A concrete
    0-d integer array (what ``optax.inject_hyperparams`` makes of an int in ``init``) is read; a traced one (its
    ``update``) raises: the split must be known when the update is traced."""
    if x is None or (isinstance(x, str) and x == "auto"):
        return x
    if isinstance(x, jax.core.Tracer):
        raise ValueError("TrainStream offload_adamw: gpu_state_bytes is traced (optax.inject_hyperparams makes every "
                         "number an array): name it in static_args, e.g. optax.inject_hyperparams(offload_adamw, "
                         "static_args=('gpu_state_bytes',))")
    if hasattr(x, "dtype") and np.ndim(x) == 0 and np.issubdtype(np.dtype(x.dtype), np.integer):
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ValueError(f"Invalid gpu_state_bytes: {x!r} (must be an int >= 0, in bytes, or 'auto')")
    return int(x)


def state_bytes(numel: int, fam) -> int:
    """The bytes of one leaf's state as optax keeps it (``fam``: :class:`._config.Family`): mu and nu in their
    dtypes, and a float32 master with ``master_weights=True``."""
    return int(numel) * (_ITEMSIZE[fam.mu] + _ITEMSIZE[fam.nu] + (4 if fam.master else 0))


def resident(sizes, budget: int) -> list[bool]:
    """Which leaves keep their state in device memory: in tree order, each whose ``sizes`` (bytes per device) fit in
    what the earlier ones left of ``budget`` (first fit: one that does not fit is skipped, a later smaller one may
    fit), as the torch adapter places parameters; but never one leaf alone in a tree of several. XLA compiles
    optax.adamw of one leaf in another form (its ``A / broadcast(1 - b**t)`` becomes ``A * (1 / (1 - b**t))`` where
    that scalar has one use: :data:`trainstream.contract.OX_FORM_R`), which would not be the whole tree's bits."""
    out, used = [], 0
    for need in sizes:
        out.append(budget > 0 and used + need <= budget)
        used += need if out[-1] else 0
    return [False] * len(out) if sum(out) == 1 < len(out) else out


def auto_budget(leaves) -> int:
    """``gpu_state_bytes="auto"``: the least, over the leaves' devices, of what XLA's allocator has not yet used
    (``memory_stats()``: ``bytes_limit`` less ``peak_bytes_in_use``, so a step run before ``init`` counts with its
    peak) less :data:`AUTO_GPU_HEADROOM` of ``bytes_limit``; ``NotImplementedError`` where a device reports none,
    and over several processes (each would size it by its own devices, and their programs must agree)."""
    if jax.process_count() > 1:
        raise NotImplementedError("TrainStream offload_adamw: gpu_state_bytes='auto' over several processes "
                                  "(jax.distributed): each would size it by its own devices' free memory, and every "
                                  "process must keep the same leaves in device memory: pass a number of bytes")
    concrete = [x for x in leaves if not isinstance(x, jax.core.Tracer) and hasattr(x, "sharding")]
    devices = {d for x in concrete for d in x.sharding.addressable_devices} or {jax.local_devices()[0]}
    budgets = []
    for d in sorted(devices, key=lambda d: d.id):
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            raise NotImplementedError(
                f"TrainStream offload_adamw: gpu_state_bytes='auto' sizes the state kept in device memory by what "
                f"the device's allocator has free (device.memory_stats()), which {d} (platform {d.platform}) does "
                "not report: pass a number of bytes")
        limit = int(stats["bytes_limit"])
        used = max(int(stats.get("peak_bytes_in_use", 0)), int(stats.get("bytes_in_use", 0)))
        budgets.append(max(0, int(limit - used - AUTO_GPU_HEADROOM * limit)))
    return min(budgets)


def _numel(x) -> int:
    """The elements of leaf ``x`` on each of its devices (a shard; the whole leaf for a tracer)."""
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    shape = tuple(np.shape(x))
    return math.prod(shape if sharding is None else sharding.shard_shape(shape))


def _noop(ctx, outs, *ins) -> None:
    """XLA has put the operands into the aliased outputs already."""


def _materialised(*lists):
    """The arrays of ``lists`` as buffers (a custom call that aliases them): XLA fuses none of their producers into
    their consumers (no FMA contraction across), as if computed in a program of their own."""
    flat = [x for xs in lists for x in xs]
    like = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in flat]
    out = iter(buffer_callback(_noop, like, input_output_aliases={i: i for i in range(len(flat))})(*flat))
    return tuple([next(out) for _ in xs] for xs in lists)


class _Parts:
    """The two sub-trees of a partition of ``treedef``'s leaves (``flags``: True for the resident ones), the other
    part's leaves replaced by ``()``, and back."""

    def __init__(self, treedef, flags):
        self.treedef, self.flags = treedef, list(flags)
        self.res = [i for i, f in enumerate(self.flags) if f]
        self.host = [i for i, f in enumerate(self.flags) if not f]

    def sub(self, leaves, keep_resident: bool):
        return jax.tree.unflatten(self.treedef, [x if f == keep_resident else () for x, f in zip(leaves, self.flags)])

    def put(self, out: list, idx, leaves) -> None:
        leaves = list(leaves)
        if len(leaves) != len(idx):
            raise AssertionError(f"TrainStream offload_adamw: {len(leaves)} leaves for {len(idx)} places")
        for i, x in zip(idx, leaves):
            out[i] = x


class Resident:
    """``init`` and ``update`` of ``offload_adamw(gpu_state_bytes=...)``: ``host`` (the host path's ``_Impl``) over the
    leaves whose state does not fit ``budget`` (bytes or ``"auto"``), optax.adamw over the others."""

    def __init__(self, host, budget):
        self.host, self.budget, self.cfg = host, budget, host.cfg
        self._splits: dict = {}  # layout key -> init's split (True: resident)
        self._eager: dict = {}  # emit_u -> the jitted update for calls outside jit

    # -- the split ---------------------------------------------------------------------------------

    def _families(self, leaves, names):
        return [family(self.cfg, leaf_dtype_name(x, p), p) for x, p in zip(leaves, names)]

    def _rule(self, leaves, fams) -> list[bool]:
        budget = auto_budget(leaves) if self.budget == "auto" else self.budget
        return resident([state_bytes(_numel(x), f) for x, f in zip(leaves, fams)], budget)

    def _split(self, params, leaves, names, fams, state_leaves, platform) -> list[bool]:
        """The split of an update: on a GPU where the state's moments are (checked against ``init``'s split of
        this layout where this transformation made it), on the CPU ``init``'s split, else the rule."""
        known = self._splits.get(layout_key(params, leaves))
        if platform != "cuda":
            return known if known is not None else self._rule(leaves, fams)
        mu, nu, master = state_leaves
        host = jax.memory.Space.Host
        seen = [getattr(jax.typeof(m), "memory_space", None) != host for m in mu]
        for i, path in enumerate(names):
            parts = [("nu", nu[i])] + ([("master", master[i])] if master[i] is not None else [])
            for what, a in parts:
                if (getattr(jax.typeof(a), "memory_space", None) != host) != seen[i]:
                    raise ValueError(f"TrainStream offload_adamw: the state's mu of leaf {path} is in "
                                     f"{'device' if seen[i] else 'host'} memory, its {what} is not: pass the state "
                                     "from init or update, or restore to tx.init(params)'s shardings")
            if known is not None and known[i] != seen[i]:
                raise ValueError(
                    f"TrainStream offload_adamw: the state of leaf {path} is in {'device' if seen[i] else 'host'} "
                    f"memory, and init (gpu_state_bytes={self.budget!r}) placed it in "
                    f"{'device' if known[i] else 'pinned host'} memory: pass the state from init or update, or "
                    "restore to tx.init(params)'s shardings (orbax: jax.tree.map(ocp.utils.to_shape_dtype_struct, "
                    "state))")
        return seen

    def host_plan(self, leaves, names, platform: str, flags=None) -> dict[str, float]:
        """The host path's plan (:meth:`trainstream.jax._transform._Impl.host_plan`) of the leaves whose state is
        in host memory (on the CPU all of them: XLA:CPU's device memory is host memory), with ``gpu_state_bytes``
        (per device) and ``gpu_state_leaves`` of the others."""
        fams = self._families(leaves, names)
        flags = self._rule(leaves, fams) if flags is None else flags
        kept = [i for i, f in enumerate(flags) if not f or platform != "cuda"]
        plan = self.host.host_plan([leaves[i] for i in kept], [names[i] for i in kept], platform)
        plan["gpu_state_bytes"] = float(sum(state_bytes(_numel(x), f) for x, f, r in zip(leaves, fams, flags) if r))
        plan["gpu_state_leaves"] = float(sum(flags))
        return plan

    # -- init and update ---------------------------------------------------------------------------

    def _optax(self, mask):
        """optax.adamw (optax.adam's bits where weight_decay is 0) of these hyper-parameters, ``mask`` its own."""
        c = self.cfg
        return optax.adamw(c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps, eps_root=c.eps_root,
                           mu_dtype=None if c.mu_dtype is None else jnp.dtype(c.mu_dtype), weight_decay=c.weight_decay,
                           mask=mask, nesterov=c.nesterov)

    def init(self, params) -> OffloadAdamWState:
        leaves, treedef = jax.tree.flatten(params)
        names = paths(params)
        fams = self._families(leaves, names)
        platform = platform_of(leaves)
        check_gpu_mode(platform, self.cfg)
        flags = self._rule(leaves, fams)
        _budget.check(self.host_plan(leaves, names, platform, flags), _HINT)  # before any array is made
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            self._splits[layout_key(params, leaves)] = flags
        parts, n = _Parts(treedef, flags), len(leaves)
        mu, nu, master, count = [None] * n, [None] * n, [None] * n, None
        if parts.host:
            st = self.host.init(parts.sub(leaves, False))
            parts.put(mu, parts.host, jax.tree.leaves(st.mu))
            parts.put(nu, parts.host, jax.tree.leaves(st.nu))
            parts.put(master, parts.host, jax.tree.leaves(st.master, is_leaf=is_none))
            count = st.count
        if parts.res:  # optax's own state, on the parameters' devices (fp32 masters: of their float32 copies)
            w = [x.astype(jnp.float32) if f.master else x for x, f in zip(leaves, fams)]
            st = self._optax(None).init(parts.sub(w, True))
            parts.put(mu, parts.res, jax.tree.leaves(optax.tree_utils.tree_get(st, "mu")))
            parts.put(nu, parts.res, jax.tree.leaves(optax.tree_utils.tree_get(st, "nu")))
            parts.put(master, parts.res, [w[i] if fams[i].master else None for i in parts.res])
            if count is None:
                count = optax.tree_utils.tree_get(st, "ScaleByAdamState").count
        col = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
        return OffloadAdamWState(count, col(mu), col(nu), col(master))

    def _optax_inputs(self, parts, g, p, master, fams, platform):
        """What optax.adamw sees of each leaf: ``(gradients, params)``, the resident fp16/bf16 leaves with an fp32
        master as its reference takes them (the master, fed the upcast gradient; on the CPU both materialised, as in
        a program of their own, and the master the weights passed in where it no longer rounds to them); and the
        gradients clip_by_global_norm takes (every leaf with a master upcast: optax's on the fp32 masters)."""
        g_opt, w = list(g), list(p)
        halves = [i for i in parts.res if fams[i].master]
        if halves:
            m_in = [master[i] if platform == "cuda" else C.master_of_weights(master[i], p[i], xp=jnp) for i in halves]
            g32 = [g[i].astype(jnp.float32) for i in halves]
            if platform == "cpu":  # (XLA:CPU drops optimization barriers)
                m_in, g32 = _materialised(m_in, g32)
            for i, m, gi in zip(halves, m_in, g32):
                w[i], g_opt[i] = m, gi
        clip = [x.astype(jnp.float32) if f.master and i in parts.host else x
                for i, (x, f) in enumerate(zip(g_opt, fams))]
        return g_opt, w, clip

    def _resident_update(self, parts, g, w, p, state, decay, emit_u):
        """optax.adamw over the resident leaves: ``g`` and ``w`` its gradients and params of every leaf
        (:meth:`_optax_inputs`, the gradients clipped), ``p`` the params passed in, ``state`` the count and the state's
        leaves ``(mu, nu, master)``: ``(firsts, mu', nu', masters', count')`` of the resident leaves."""
        cfg, sub = self.cfg, lambda xs: parts.sub(xs, True)  # noqa: E731
        count, (mu, nu, master) = state
        tx = self._optax(None if cfg.mask is None else sub(decay))
        opt_state = optax.tree_utils.tree_set(tx.init(sub(w)), count=count, mu=sub(mu), nu=sub(nu))
        u, new = tx.update(sub(g), opt_state, sub(w))
        u = jax.tree.leaves(u)
        firsts, masters = [], []
        for j, i in enumerate(parts.res):
            if master[i] is not None:  # the master's rounding; update: the float32 difference apply_updates rounds to
                m = optax.apply_updates(w[i], u[j])
                new_w = m.astype(p[i].dtype)
                firsts.append(new_w.astype(jnp.float32) - p[i].astype(jnp.float32) if emit_u else new_w)
                masters.append(m)
            else:
                firsts.append(u[j] if emit_u else optax.apply_updates(p[i], u[j]))
                masters.append(None)
        tree_get = optax.tree_utils.tree_get
        return (firsts, jax.tree.leaves(tree_get(new, "mu")), jax.tree.leaves(tree_get(new, "nu")), masters,
                tree_get(new, "ScaleByAdamState").count)

    def _apply(self, grads, state, params, emit_u: bool):
        """One traced update over both parts: ``(updates or new params, new state)``."""
        from jax._src.interpreters import batching  # noqa: PLC0415
        if any(isinstance(x, batching.BatchTracer) for t in (grads, state, params) for x in jax.tree.leaves(t)):
            raise NotImplementedError("TrainStream offload_adamw under jax.vmap: its update has no batching rule; vmap "
                                      "a model's loss, not its optimizer (several models: one optimizer state each)")
        cfg = self.cfg
        p, g, p_def, names, _, fams, mu, nu, master = self.host._flatten(grads, state, params)
        platform = platform_of(p + g)
        check_gpu_mode(platform, cfg)
        flags = self._split(params, p, names, fams, (mu, nu, master), platform)
        parts, n = _Parts(p_def, flags), len(p)
        decay = resolve_mask(cfg.mask, params, p_def, "mask", True)
        g_opt, w, clip = self._optax_inputs(parts, g, p, master, fams, platform)
        firsts, mu2, nu2, m2, count = [None] * n, list(mu), list(nu), list(master), None
        if parts.host:
            # clip_by_global_norm's norm over the whole tree (the host path's own: the float32-upcast gradients)
            norm = optax.tree.norm(clip) if cfg.max_grad_norm is not None else None
            sub = lambda xs: parts.sub(xs, False)  # noqa: E731
            out, st = self.host._apply(sub(g), OffloadAdamWState(state.count, sub(mu), sub(nu), sub(master)), sub(p),
                                       emit_u, decay=[decay[i] for i in parts.host], norm=norm, n_tree=n)
            parts.put(firsts, parts.host, jax.tree.leaves(out))
            parts.put(mu2, parts.host, jax.tree.leaves(st.mu))
            parts.put(nu2, parts.host, jax.tree.leaves(st.nu))
            parts.put(m2, parts.host, jax.tree.leaves(st.master, is_leaf=is_none))
            count = st.count
        if parts.res:
            if cfg.max_grad_norm is not None:  # chain(clip_by_global_norm(M), adamw): optax's, over the whole tree
                clipped = optax.clip_by_global_norm(cfg.max_grad_norm).update(clip, optax.EmptyState())[0]
                g_opt = [c if i in parts.res else x for i, (c, x) in enumerate(zip(clipped, g_opt))]
            f, m, v, ms, c = self._resident_update(parts, g_opt, w, p, (state.count, (mu, nu, master)), decay, emit_u)
            for out, got in ((firsts, f), (mu2, m), (nu2, v), (m2, ms)):
                parts.put(out, parts.res, got)
            count = c if count is None else count
        col = lambda xs: jax.tree.unflatten(p_def, xs)  # noqa: E731
        return col(firsts), OffloadAdamWState(count, col(mu2), col(nu2), col(m2))

    def _run(self, grads, state, params, emit_u: bool):
        if any(isinstance(x, jax.core.Tracer) for t in (grads, state, params) for x in jax.tree.leaves(t)):
            return self._apply(grads, state, params, emit_u)
        # outside jit: a program of its own, the host path knowing its part's layout (as its own eager update does)
        if params is not None and isinstance(state, OffloadAdamWState):
            leaves, names = jax.tree.leaves(params), paths(params)
            state_leaves = (jax.tree.leaves(state.mu), jax.tree.leaves(state.nu),
                            jax.tree.leaves(state.master, is_leaf=is_none))
            if all(len(x) == len(leaves) for x in state_leaves):  # else _flatten says what differs
                flags = self._split(params, leaves, names, self._families(leaves, names), state_leaves,
                                    platform_of(leaves))
                parts = _Parts(jax.tree.structure(params), flags)
                host = parts.sub(leaves, False)
                self.host._remember_layout(host, jax.tree.leaves(host), paths(host))
        if emit_u not in self._eager:
            self._eager[emit_u] = jax.jit(lambda g, s, p: self._apply(g, s, p, emit_u))
        return self._eager[emit_u](grads, state, params)

    def update(self, updates, state, params=None, **extra_args):
        """optax's ``update``; ``extra_args`` (optax's extra-arguments protocol) are ignored, as optax.adamw's."""
        del extra_args
        return self._run(updates, state, params, emit_u=True)
