"""Which torch AdamW/Adam a param group asks for: the group's keys resolved as ``torch.optim.Adam.step`` resolves
them (:func:`impl_of`, :func:`recipe`), what can never be offered (:func:`refuse`), and what the engine does not
compute yet (:func:`unbuilt`: the one place that refuses arithmetic, at construction, ``add_param_group``,
``load_state_dict`` and every ``step()``).

A slot's arithmetic is a :class:`trainstream.contract.TorchRecipe`, handed to ``Engine.add_param(recipe=...)``
(:func:`engine_kwargs`); the engine computes every recipe on the host and refuses itself (``NotImplementedError``)
one that a device placement's kernels lack.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach, _to_scalar

from ..backends.torch import _DTYPE_NAME
from .. import contract as C
from ..contract import TorchRecipe
from . import _dist as D

__all__ = ["TorchRecipe", "FLAGS", "LAYOUT", "validate", "hyper", "impl_of", "recipe", "refuse", "unbuilt", "changed",
           "engine_kwargs"]


def validate(lr: Any, betas: Any, eps: Any, weight_decay: Any, foreach: Any, capturable: Any) -> tuple:
    """``torch.optim.Adam.__init__``'s checks, in its order, with its exception types and messages (torch 2.13);
    returns ``betas`` as torch keeps them."""
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    return tuple(map(_to_scalar, betas))


def hyper(group: dict[str, Any]) -> C.AdamWHyperParams:
    """A param group's hyper-parameters, as the contract takes them (a Tensor ``lr``: its value)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr.item())
    return C.validate_hyperparams(lr, group["betas"], group["eps"], group["weight_decay"])


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
    dtype = _DTYPE_NAME.get(p.dtype, str(p.dtype))
    return TorchRecipe(impl=impl, platform=D.local(p).device.type, dtype=dtype,
                       master=bool(master_weights) and dtype != "float32", amsgrad=bool(group.get("amsgrad")),
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
    """The one place that refuses arithmetic the engine does not reproduce (``NotImplementedError`` naming why): a
    Tensor ``lr`` on a CUDA device (torch reads it on the device in float32 arithmetic of its own, not reproduced;
    a CPU Tensor ``lr`` is). Everything else is a :class:`~trainstream.contract.TorchRecipe` the host computes;
    the device placement refuses at registration what its kernels lack (``mode="cpu"`` then)."""
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        raise NotImplementedError(
            f"{where}: a Tensor lr on {lr.device} is not reproduced (torch's {r.impl} implementation reads it on the "
            "device); pass a float, or a CPU tensor (e.g. torch.tensor(1e-3))")


#: The fields of a recipe that fix its slot's state layout (no group edit may change them mid-run).
LAYOUT = ("platform", "dtype", "master", "amsgrad")


def changed(old: TorchRecipe, new: TorchRecipe, where: str) -> bool:
    """Whether a group edited after its parameters were registered (or a loaded checkpoint's group) asks for other
    arithmetic, ``new`` instead of ``old``: the engine follows a change of implementation, ``maximize``,
    ``decoupled_weight_decay`` or a Tensor ``lr`` (``Engine.set_recipe``), as torch's optimizer does from its next
    step; one of the state's layout (``amsgrad`` toggled) is refused, naming what changed."""
    if old == new:
        return False
    if fixed := [k for k in LAYOUT if getattr(old, k) != getattr(new, k)]:
        what = ", ".join(f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}" for k in fixed)
        raise NotImplementedError(
            f"{where}: the group now asks for another state layout than its parameters were registered with ({what}); "
            "changing it mid-run is not followed. Build the optimizer with these settings (or load a checkpoint "
            "into one built with them).")
    return True


def engine_kwargs(r: TorchRecipe) -> dict[str, Any]:
    """``Engine.add_param``'s arguments for a slot of recipe ``r``."""
    return {"recipe": r}
