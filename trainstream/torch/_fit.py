"""``OffloadAdamW.host_memory_plan``: the host memory a new optimizer over given parameters will take, against what
this host (or another machine, ``host_memory``) has, and with ``options=True`` which scheme and placement fit there
and how large the model may grow with each (:func:`host_memory_plan`). Nothing is allocated; parameters on the
``meta`` device plan a model that is not built (as CUDA parameters).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..core import _budget
from . import _dist as D
from . import _recipe as R
from ._params import _facts, _plan, check_bounded, check_placement, ring_bytes

__all__ = ["OPTIONS", "host_memory_plan"]

#: The setups ``options=True`` compares, in this order: ``(master_weights, mode, bounded_staging)``. Torch's own
#: state first (the reference's layout, fewest bytes), the host placement before the device ones (the fastest here
#: where it fits: docs/performance.md).
OPTIONS = ((False, "cpu", True), (False, "cpu", False), (False, "hybrid", True), (False, "hybrid", False),
           (False, "gpu", False), (True, "cpu", True), (True, "cpu", False), (True, "hybrid", True),
           (True, "hybrid", False), (True, "gpu", False))


def _flatten(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], amsgrad: bool
             ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The parameters of ``params`` (tensors or param groups) and each one's group (with ``amsgrad``'s default)."""
    groups = list(params)
    if not (groups and isinstance(groups[0], dict)):
        groups = [{"params": groups}]
    flat, of = [], []
    for g in groups:
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        flat += ps
        of += [{"amsgrad": amsgrad, **g}] * len(ps)
    return flat, of


def _recipes(flat: list[torch.Tensor], groups: list[dict[str, Any]], master_weights: bool) -> list[R.TorchRecipe]:
    """Each parameter's recipe (a ``meta`` parameter's as on CUDA)."""
    out = []
    for p, g in zip(flat, groups):
        r = R.recipe(g, p, "single", master_weights)
        out.append(r._replace(platform="cuda") if D.local(p).device.type == "meta" else r)
    return out


def _one(flat, groups, *, mode, gpu_share, gpu_params, gpu_state_bytes, pin_moments, host_margin, master_weights,
         bounded_staging, threads, host_memory) -> dict[str, float]:
    """The plan of one setup."""
    recipes = _recipes(flat, groups, master_weights)
    resident = 0 if gpu_state_bytes == "auto" else gpu_state_bytes  # "auto": all offloaded at first
    facts = _facts(flat, recipes)
    share = _budget.hybrid_elems(facts, gpu_share, resident) if mode == "hybrid" else 0
    where = _budget.assign(facts, mode, device_elems=share, gpu_state_bytes=resident, last=gpu_params == "last")
    return _plan(flat, where, recipes, pin_moments, host_margin, None, bounded_staging,
                 ring_bytes(threads) if bounded_staging else 0, host_memory)


def _option(flat, groups, numel: int, kw: dict[str, Any], master_weights: bool, mode: str, bounded: bool
            ) -> dict[str, Any]:
    """One row of ``options``: the setup, its plan's ``needed`` and ``fits``, its host bytes per parameter (the
    ring left out), and ``max_params``: the most parameters of this model's proportions whose plan fits (-1: the
    host's memory unknown), those whose state ``gpu_state_bytes`` holds included."""
    kw = {**kw, "mode": mode, "master_weights": master_weights, "bounded_staging": bounded}
    plan = _one(flat, groups, **kw)
    fixed = ring_bytes(kw["threads"]) if bounded and mode != "gpu" else 0
    alone = _one(flat, groups, **{**kw, "gpu_state_bytes": 0})  # every parameter's state offloaded
    per = (alone["needed"] - fixed) / numel if numel else 0.0
    resident = kw["gpu_state_bytes"] if isinstance(kw["gpu_state_bytes"], int) else 0
    facts = _facts(flat, _recipes(flat, groups, master_weights))
    state = sum(_budget.state_bytes(n, d, r) for n, d, t, r in facts if t)
    if plan["usable"] < 0 or per <= 0:
        grow = -1
    else:
        grow = int(max(0.0, plan["usable"] - fixed) // per) + (int(resident // (state / numel)) if state else 0)
    return {"master_weights": master_weights, "mode": mode, "bounded_staging": bounded,
            "gpu_state_bytes": resident, "needed": plan["needed"], "fits": bool(plan["fits"]),
            "bytes_per_param": per, "fixed_bytes": float(fixed), "max_params": grow}


def host_memory_plan(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *, mode: str = "cpu",
                     gpu_share: float = 0.3, gpu_params: str = "first", gpu_state_bytes: int = 0,
                     pin_moments: bool = False, host_margin: float | None = _budget.MARGIN, amsgrad: bool = False,
                     master_weights: bool = False, bounded_staging: bool = False, threads: int | None = None,
                     host_memory: int | None = None, options: bool = False) -> dict[str, Any]:
    """:meth:`OffloadAdamW.host_memory_plan`: the plan of a new optimizer over ``params``, nothing allocated; with
    ``options`` also ``options``, one row per setup of :data:`OPTIONS` (:func:`_option`), and ``fitting``: the
    first of them that fits (None: none)."""
    check_placement(mode, gpu_share, gpu_params, gpu_state_bytes)
    check_bounded(bounded_staging, mode, master_weights, None)
    if host_memory is not None and (isinstance(host_memory, bool) or not isinstance(host_memory, int)
                                    or host_memory <= 0):
        raise ValueError(f"Invalid host_memory: {host_memory!r} (must be an int > 0, in bytes, or None: this host's)")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"Invalid threads: {threads!r} (must be an int >= 1 or None)")
    flat, groups = _flatten(params, amsgrad)
    kw = dict(gpu_share=gpu_share, gpu_params=gpu_params, gpu_state_bytes=gpu_state_bytes, pin_moments=pin_moments,
              host_margin=host_margin, threads=threads, host_memory=host_memory)
    out: dict[str, Any] = _one(flat, groups, mode=mode, master_weights=master_weights,
                               bounded_staging=bounded_staging, **kw)
    if options:
        numel = sum(D.local(p).numel() for p in flat)
        rows = [_option(flat, groups, numel, kw, *o) for o in OPTIONS]
        out["options"] = rows
        out["fitting"] = next((r for r in rows if r["fits"]), None)
    return out
