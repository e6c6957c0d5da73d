"""The state of :func:`trainstream.jax.offload_adamw` (:class:`OffloadAdamWState`, shaped as optax's) and its
checkpoints outside orbax: :func:`state_dict`, :func:`load_state_dict`, and :func:`close` to release it now.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["OffloadAdamWState", "close", "is_none", "load_state_dict", "state_dict"]


class OffloadAdamWState(NamedTuple):
    """The state of :func:`~trainstream.jax.offload_adamw`, shaped as optax's ``ScaleByAdamState`` (so optax's wrappers, flax's
    ``nnx.Optimizer`` and orbax handle it as optax.adamw's). ``count``: int32, the updates so far. ``mu``, ``nu``:
    trees shaped like the parameters, in optax's dtypes (nu the leaf's, mu ``mu_dtype`` or the leaf's; float32 with
    ``master_weights=True``). ``master``: the float32 master of each fp16/bf16 leaf with ``master_weights=True``,
    else None. On a GPU the moments and masters are ``memory_kind="pinned_host"`` arrays."""

    count: Any
    mu: Any
    nu: Any
    master: Any


def is_none(x) -> bool:
    """``is_leaf`` of the ``master`` tree (None for float32 leaves)."""
    return x is None


def state_dict(state: OffloadAdamWState, params=None) -> dict:
    """``{"count", "master", "exp_avg", "exp_avg_sq"}`` as NumPy copies, in ``torch.optim.AdamW``'s names (the moments
    in the state's dtypes); ``master``: each leaf's float32 master, for leaves without one the weights themselves,
    upcast (pass ``params`` if there are any). Whole
    arrays only: the state of several processes (``jax.distributed``) raises ``ValueError``; save it with orbax."""
    for x in jax.tree.leaves(state):
        if not getattr(x, "is_fully_addressable", True):
            raise ValueError("TrainStream state_dict gathers the whole state into this process, and part of it lives "
                             "on other processes' devices (jax.distributed): save the state itself with orbax")
    # copies: a NumPy view of a state array would keep XLA from donating it afterwards
    to_np = lambda x: np.array(jax.device_get(x), copy=True)  # noqa: E731
    masters = jax.tree.leaves(state.master, is_leaf=is_none)
    if any(m is None for m in masters):
        if params is None:
            raise ValueError("TrainStream state_dict: leaves without an fp32 master are their own: pass params")
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

    def put(a, ref, dtype=None):
        a = np.asarray(a, ref.dtype if dtype is None else dtype)  # the state's dtype (optax's)
        sh = getattr(ref, "sharding", None)
        return jax.device_put(a, sh) if sh is not None else jnp.asarray(a)

    old_m = jax.tree.leaves(state.master, is_leaf=is_none)
    if any(m is not None for m in old_m) and "master" not in cols:
        raise ValueError("TrainStream load_state_dict: checkpoint lacks 'master' (fp16/bf16 leaves)")
    mu = [put(a, r) for a, r in zip(cols["exp_avg"], like)]
    nu = [put(a, r) for a, r in zip(cols["exp_avg_sq"], jax.tree.leaves(state.nu))]
    master = [None if m is None else put(cols["master"][i], m, np.float32) for i, m in enumerate(old_m)]
    return OffloadAdamWState(put(count, state.count, np.int32), jax.tree.unflatten(treedef, mu),
                             jax.tree.unflatten(treedef, nu), jax.tree.unflatten(treedef, master))


def close(state: OffloadAdamWState) -> None:
    """Release the state's memory now (host memory on a GPU) instead of when its arrays are collected: every array
    of ``state`` is deleted and the state unusable. Idempotent. (The process's host workers stay.)"""
    for x in jax.tree.leaves(state):
        delete = getattr(x, "delete", None)
        if delete is not None and not (hasattr(x, "is_deleted") and x.is_deleted()):
            delete()
