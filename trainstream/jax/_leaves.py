"""What the JAX adapter's transformations (:mod:`._transform`, :mod:`._resident`) read of a parameter pytree: its
leaves' paths, its layout key, optax's ``mask=`` resolved per leaf, the platform of its arrays, and whether
``mode="gpu"`` can run there.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

__all__ = ["check_gpu_mode", "layout_key", "paths", "platform_of", "resolve_mask"]


def paths(tree) -> list[str]:
    """Each leaf's path (``jax.tree_util.keystr``), for messages."""
    return [jax.tree_util.keystr(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def layout_key(params, leaves) -> tuple:
    """What identifies a parameter pytree's layout between ``init`` and ``update``: its structure, shapes, dtypes."""
    return (jax.tree.structure(params), tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves))


def resolve_mask(mask, params, treedef, name: str, default: bool) -> list[bool]:
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


def platform_of(leaves) -> str:
    """``"cpu"`` or ``"cuda"``: where the arrays live (for tracers: the default backend)."""
    concrete = [x for x in leaves if not isinstance(x, jax.core.Tracer) and getattr(x, "devices", None) is not None]
    plats = {d.platform for x in concrete for d in x.devices()} or {jax.default_backend()}
    if len(plats) > 1:
        raise ValueError(f"TrainStream offload_adamw: the arrays are on several platforms {sorted(plats)}")
    (p,) = plats
    if p not in ("cpu", "gpu", "cuda"):
        raise NotImplementedError(f"TrainStream offload_adamw: platform {p!r}; supported are the CPU and CUDA GPUs")
    return "cpu" if p == "cpu" else "cuda"


def check_gpu_mode(platform: str, cfg) -> None:
    """``mode="gpu"`` needs a CUDA GPU and the parameters on it."""
    if cfg.mode != "gpu":
        return
    if platform != "cuda":
        with contextlib.suppress(RuntimeError):  # raised by jax.devices("gpu") without a GPU backend
            if jax.devices("gpu"):
                raise ValueError("TrainStream offload_adamw: mode='gpu' but the parameters are on the CPU: "
                                 "jax.device_put(params, jax.devices('gpu')[0]) first, or use mode='cpu'")
        raise RuntimeError("TrainStream offload_adamw: mode='gpu' (the GPU kernel) needs a CUDA GPU visible to "
                           f"JAX; this process has none (jax.devices() = {jax.devices()})")
