"""Which torch AdamW/Adam a param group asks for: the group's keys resolved as ``torch.optim.Adam.step`` resolves
them (:func:`impl_of`, :func:`recipe`), what can never be offered (:func:`refuse`), and what the engine does not
compute yet (:func:`unbuilt`: the one place that refuses arithmetic, at construction, ``add_param_group``,
``load_state_dict`` and every ``step()``).

Integration with the engine of issue 34 (``trainstream.contract.TorchRecipe``, ``Engine.add_param(recipe=...)``)
touches this module only: the three places marked ``INTEGRATION``.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Sequence

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach

from ..backends.torch import _DTYPE_NAME
from . import _dist as D

__all__ = ["TorchRecipe", "FLAGS", "impl_of", "recipe", "refuse", "unbuilt", "changed", "engine_kwargs"]


# INTEGRATION(arith): `from ..contract import TorchRecipe` replaces this stand-in (same fields; built by keyword).
class TorchRecipe(NamedTuple):
    """A slot's arithmetic (PLAN34): torch's implementation (``"single" | "foreach" | "fused"``), the parameters'
    device type (whose arithmetic), the parameter's dtype name, ``master_weights``, torch's flags."""

    impl: str
    platform: str
    dtype: str
    master: bool
    amsgrad: bool
    maximize: bool
    decoupled: bool
    lr_tensor: bool


#: The flags of a torch Adam/AdamW param group and their values when a loaded group lacks them (``Adam.__setstate__``).
FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
             decoupled_weight_decay=False)


def impl_of(group: dict[str, Any], params: Sequence[torch.Tensor]) -> str:
    """The implementation ``torch.optim.adam.adam`` runs for ``group`` over ``params`` (those with a gradient at a
    step): ``fused=True`` wins; ``foreach=True``; else torch's default for them (foreach on CUDA unless a Tensor
    ``lr`` without ``capturable``, or a parameter type torch does not run foreach on)."""
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused is None and foreach is None:
        _, foreach = _default_to_fused_or_foreach(list(params), bool(group.get("differentiable")), use_fused=False)
        if foreach and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
            foreach = False
    return "fused" if fused else "foreach" if foreach else "single"


def recipe(group: dict[str, Any], p: torch.Tensor, impl: str, master_weights: bool) -> TorchRecipe:
    """Parameter ``p``'s recipe in ``group`` (``impl``: :func:`impl_of` of the group)."""
    return TorchRecipe(impl=impl, platform=D.local(p).device.type, dtype=_DTYPE_NAME.get(p.dtype, str(p.dtype)),
                       master=bool(master_weights), amsgrad=bool(group.get("amsgrad")),
                       maximize=bool(group.get("maximize")),
                       decoupled=bool(group.get("decoupled_weight_decay", True)),
                       lr_tensor=isinstance(group.get("lr"), torch.Tensor))


def refuse(group: dict[str, Any], where: str) -> None:
    """What no TrainStream optimizer offers, set in ``group`` (``where``: "OffloadAdamW", "param group 2", ...):
    ``NotImplementedError`` naming why and what to use instead."""
    if group.get("differentiable"):
        raise NotImplementedError(
            f"{where}: differentiable=True is not offered: the update runs on host memory outside autograd, so no "
            "gradient can flow through step(). Use torch.optim.AdamW/Adam(differentiable=True) for that loop.")
    if group.get("capturable"):
        raise NotImplementedError(
            f"{where}: capturable=True is not offered: step() runs on host threads (or launches from the host), which "
            "a CUDA graph cannot capture. Leave capturable=False (the default) and keep step() outside the captured "
            "region; torch.compile of the model is fine.")
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and any(isinstance(b, torch.Tensor) for b in betas):
        raise NotImplementedError(f"{where}: Tensor betas are not offered; pass floats, e.g. betas=(0.9, 0.999)")


def unbuilt(r: TorchRecipe, group: dict[str, Any], where: str) -> None:
    """INTEGRATION(arith): the one place that refuses arithmetic the engine does not compute yet. Today's engine
    computes torch's default/foreach AdamW in float32 (fp16/bf16 parameters: only with an fp32 master,
    ``master_weights=True``), on the CPU either implementation (the same bits), on CUDA foreach. Once the engine
    takes a recipe (``Engine.add_param(recipe=...)``), this keeps only what that engine refuses itself."""
    why = None
    if r.impl == "fused":
        why = "fused=True (torch's fused kernel's bits) is not built yet; pass fused=None"
    elif r.amsgrad:
        why = "amsgrad=True is not built yet"
    elif r.maximize:
        why = "maximize=True is not built yet"
    elif r.lr_tensor:
        why = "a Tensor lr is not built yet; pass a float"
    elif not r.decoupled and _nonzero(group.get("weight_decay", 0.0)):
        why = ("Adam's L2 weight decay (decoupled_weight_decay=False with weight_decay != 0) is not built yet; "
               "decoupled_weight_decay=True gives AdamW")
    elif r.dtype in ("float16", "bfloat16") and not r.master:
        why = (f"{r.dtype} parameters with their state in {r.dtype}, as torch keeps it, are not built yet; "
               "master_weights=True keeps an fp32 master and fp32 moments")
    elif r.platform == "cuda" and r.impl == "single":
        why = "torch's single-tensor implementation on CUDA (foreach=False, or a Tensor lr) is not built yet"
    if why is not None:
        raise NotImplementedError(f"{where}: {why}")


def _nonzero(wd: Any) -> bool:
    return not isinstance(wd, numbers.Real) or wd != 0


def changed(old: TorchRecipe, new: TorchRecipe, where: str) -> None:
    """A group edited after its parameters were registered (or a loaded checkpoint's group) asks for another
    arithmetic: refused, naming what changed. INTEGRATION(arith): where the engine can re-set a slot's recipe
    (PLAN34 has no such call), a change it supports may be followed here instead."""
    if old != new:
        what = ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in zip(TorchRecipe._fields, old, new) if a != b)
        raise NotImplementedError(
            f"{where}: the group now asks for other arithmetic than its parameters were registered with ({what}); "
            "changing it mid-run is not followed. Build the optimizer with these settings (or load a checkpoint "
            "into one built with them).")


def engine_kwargs(r: TorchRecipe) -> dict[str, Any]:
    """INTEGRATION(arith): ``{"recipe": r}`` once ``Engine.add_param`` takes one; today's engine computes the only
    arithmetic :func:`unbuilt` lets through, its default."""
    return {}
