"""The plan of one traced update of :func:`trainstream.jax.offload_adamw` and its update on XLA:CPU.

A :class:`Plan` is what the callbacks of an update need (the leaves' dtypes and sizes, ``update`` or ``step``); it is
static (the compiled program keeps it through its callbacks), holds no array, and is shared by equal configurations
(:func:`plan_for`). On XLA:CPU the plan is the callback itself (:func:`cpu_apply`): its leaves go, as flat NumPy views of
XLA's buffers, to the host workers of this process's engine (:func:`host_engine`, ``Engine.update_external``); on
XLA:GPU its :attr:`Plan.gpu` (:mod:`._gpu`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from .. import _cores
from ..backends import jax as xb
from ..core import Engine, ExternalUpdate
from . import _gpu, _sharding

__all__ = ["Plan", "cpu_apply", "host_engine", "is_number", "plan_for"]

_engines: dict[tuple, Engine] = {}
_engines_lock = threading.Lock()


def _finish_in_flight() -> None:
    with contextlib.suppress(Exception):  # exiting; JAX's own hook reports a failed program
        jax.effects_barrier()


def host_engine(threads: int, nice: int) -> Engine:
    """The host engine (no slots, the host workers; ``Engine.update_external``) of ``threads`` workers at nice value
    ``nice``, shared in this process for its lifetime (a forked child gets its own)."""
    key = (os.getpid(), threads, nice)
    if key not in _engines:  # every callback asks: no lock once it exists
        with _engines_lock:
            if key not in _engines:
                _engines[key] = Engine(None, mode="cpu", threads=threads, convention="optax", worker_nice=nice)
                # after the engine's finalizer, so first at exit: callbacks still in flight find live workers
                atexit.unregister(_finish_in_flight)
                atexit.register(_finish_in_flight)
    return _engines[key]


class Plan:
    """What the callbacks of one traced update need, shared by equal configurations; static (the compiled
    program keeps it through its callbacks), so it holds no array. ``cfg``: ``offload_adamw``'s checked arguments."""

    __slots__ = ("n", "kinds", "numels", "halves", "mu_kinds", "nu_kinds", "u_kinds", "emit_u", "mode", "engine_key",
                 "gpu", "__weakref__")

    def __init__(self, cfg, kinds, numels, emit_u: bool, platform: str, families=None):
        self.n, self.kinds, self.numels, self.emit_u = len(kinds), tuple(kinds), tuple(numels), emit_u
        if families is None:  # float32 state, fp32 masters of fp16/bf16 leaves
            families = [("float32", "float32", k != "float32") for k in kinds]
        self.halves = tuple(i for i, f in enumerate(families) if f[2])  # the leaves with an fp32 master
        self.mu_kinds, self.nu_kinds = tuple(f[0] for f in families), tuple(f[1] for f in families)
        # optax's update's dtype: nu's where mu is of the leaf's dtype, else float32 (float32 mu)
        self.u_kinds = tuple(nu if mu == nu else "float32" for mu, nu, _ in families)
        self.mode = cfg.mode
        threads = cfg.threads or _cores.default_threads(_sharding._local_processes())
        self.engine_key = (threads, cfg.worker_nice)
        self.gpu = _gpu._Update(self) if platform == "cuda" else None  # XLA:GPU's callback (XLA keys programs by it)

    @property
    def engine(self) -> Engine:
        return host_engine(*self.engine_key)

    def __call__(self, ctx, outs, scal, count, *ins) -> None:
        """``(S, t, grads, params, mu, nu, masters) -> (firsts, mu', nu', masters')`` on XLA:CPU, ``firsts`` the
        new weights (``step``: aliased to the params) or ``u`` (``update``; a placeholder for fp16/bf16 leaves).
        ``t``: unused."""
        n, view = self.n, xb.flat_view
        params, mus, nus = ins[n:2 * n], outs[n:2 * n], outs[2 * n:3 * n]
        master_of = dict(zip(self.halves, outs[3 * n:]))
        s = np.asarray(scal)
        g = [view(x, kind) for x, kind in zip(ins[:n], self.kinds)]
        items = []
        for i, kind in enumerate(self.kinds):
            if i in master_of:  # step: the master's rounding into the params' buffer
                p = view(master_of[i], "float32")
                out, out_kind = (None, None) if self.emit_u else (view(outs[i], kind), kind)
            elif self.emit_u:  # (fp16/bf16 state: the weights' and u's bits)
                p, out, out_kind = view(params[i], kind), view(outs[i], self.u_kinds[i]), "u"
            else:
                p, out, out_kind = view(outs[i], kind), None, None  # aliased to the params
            items.append(ExternalUpdate(p, view(mus[i], self.mu_kinds[i]), view(nus[i], self.nu_kinds[i]), g[i], kind,
                                        out, out_kind, s[i]))
        self.engine.update_external(items, "cpu")


def is_number(x) -> bool:
    """A Python int or float (not a bool, not an array)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_PLANS_KEPT = 64
_plans: dict = {}
_plans_lock = threading.Lock()


def plan_for(cfg, kinds, numels, emit_u: bool, platform: str, families=None) -> Plan:
    """The plan of a layout, shared by equal configurations (the most recent ones kept): XLA's compile cache
    keys programs by their callbacks, so a new ``offload_adamw`` or jit of an equal one compiles nothing new."""
    static = tuple(v if is_number(v) or v is None or isinstance(v, str) else
                   (("callable", v) if callable(v) else "array") for v in cfg)
    families = None if families is None else tuple(tuple(f) for f in families)
    key = (static, tuple(kinds), tuple(numels), emit_u, platform, families)
    with _plans_lock:
        made = _plans[key] = _plans.pop(key, None) or Plan(cfg, kinds, numels, emit_u, platform, families)
        while len(_plans) > _PLANS_KEPT:
            _plans.pop(next(iter(_plans)))
    return made


def cpu_apply(plan: Plan, scalars, count_inc, g_leaves, p_leaves, mu, nu, masters):
    """``plan``'s update on XLA:CPU: one callback (:meth:`Plan.__call__`) over one device's leaves."""
    n, sds, f32 = plan.n, jax.ShapeDtypeStruct, jnp.float32
    first = [(sds((0,), f32) if i in plan.halves else sds(np.shape(p), jnp.dtype(plan.u_kinds[i]))) if plan.emit_u
             else sds(np.shape(p), p.dtype) for i, p in enumerate(p_leaves)]
    result = (first + [sds(np.shape(p), jnp.dtype(k)) for p, k in zip(p_leaves, plan.mu_kinds)]
              + [sds(np.shape(p), jnp.dtype(k)) for p, k in zip(p_leaves, plan.nu_kinds)]
              + [sds(np.shape(m), f32) for m in masters])
    aliases = {2 + 2 * n + j: n + j for j in range(2 * n + len(masters))}  # the state, from the first moment
    if not plan.emit_u:
        aliases.update({2 + n + i: i for i in range(n)})  # params -> new params, in place
    outs = buffer_callback(plan, result, input_output_aliases=aliases, vmap_method=None)(
        scalars, count_inc, *g_leaves, *p_leaves, *mu, *nu, *masters)
    return outs[:n], outs[n:2 * n], outs[2 * n:3 * n], outs[3 * n:]
