"""torchtitan's trainer with :class:`~trainstream.torch.OffloadAdamW` (and ``OffloadAdam``) in place of
``torch.optim.AdamW`` (``Adam``), through torchtitan's own extension points, no fork (torchtitan 0.3.0).

torchtitan builds its optimizers in ``OptimizersContainer`` (``torchtitan.components.optimizer``) from
``ParamGroupConfig`` entries that name the optimizer (``"AdamW"``, ``"Adam"``) and carry its keyword arguments;
the container adds ``fused``/``foreach`` from ``implementation`` to every group and resolves the names in
``_resolve_optimizer_factory``. :class:`OffloadOptimizersContainer` resolves two more names, ``"OffloadAdamW"`` and
``"OffloadAdam"``; :func:`offload_optimizers` turns a container config into one of its configs with every
``AdamW``/``Adam`` group renamed (the groups' arguments, ``implementation`` and the other optimizers unchanged);
:func:`offload_adamw` is the same as an ``@override`` of torchtitan's config tree, activated on its command line:

    python -m torchtitan.train --module llama3 --config llama3_8b --training.disable_cuda_graphs \\
        --override.imports trainstream.torch.torchtitan.offload_adamw

or with OffloadAdamW's own arguments: ``'trainstream.torch.torchtitan.offload_adamw={"mode": "hybrid"}'``.
The user's guide: ``docs/torchtitan.md``. This module imports torchtitan; nothing else in trainstream does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import derive, override

from ._optimizer import OffloadAdam, OffloadAdamW

__all__ = ["OffloadOptimizersContainer", "offload_adamw", "offload_optimizers"]

#: torchtitan's optimizer names and the names of their offloaded counterparts in OffloadOptimizersContainer.
RENAMES = {"AdamW": "OffloadAdamW", "Adam": "OffloadAdam"}
_FACTORIES: dict[str, Callable[..., torch.optim.Optimizer]] = {"OffloadAdamW": OffloadAdamW, "OffloadAdam": OffloadAdam}

#: OffloadAdamW's own keyword arguments (those torch.optim.AdamW lacks): once per optimizer, not per group.
OWN_ARGUMENTS = tuple(name for name in inspect.signature(OffloadAdamW).parameters
                      if name not in inspect.signature(torch.optim.AdamW).parameters)


def _check_implementation(implementation: str) -> None:
    """Refuse torchtitan's ``fused_opt_states_bf16``, which OffloadAdamW cannot reproduce."""
    if implementation == "fused_opt_states_bf16":
        raise NotImplementedError(
            "OffloadAdamW under torchtitan: optimizer.implementation='fused_opt_states_bf16' is not supported. "
            "torchtitan then keeps exp_avg and exp_avg_sq of fp32 parameters in bfloat16 (a step pre-hook creates "
            "them) and torch's fused CUDA kernel runs its mixed-precision path; OffloadAdamW keeps the moments in "
            "the parameter's dtype, so its bits would differ. Use implementation='fused' (or 'foreach', "
            "'for-loop').")


def _check_own_arguments(kwargs: dict[str, Any], where: str) -> None:
    """Only OffloadAdamW's own arguments are taken once per optimizer (torch's belong to the param groups), and not
    ``max_grad_norm``: torchtitan clips itself."""
    if kwargs.get("max_grad_norm") is not None:
        raise NotImplementedError(
            f"{where}: max_grad_norm is not supported under torchtitan. Its train_step clips param.grad itself "
            "(training.max_norm, clip_grad_norm_ with foreach=True) before optimizer.step(); on DTensor gradients that "
            "in-place scaling moves no version counter, so OffloadAdamW's own clipping, which keeps the copies made "
            "during backward, would update from gradients torchtitan has since scaled. Leave it unset: "
            "training.max_norm clips with the same bits.")
    wrong = sorted(set(kwargs) - set(OWN_ARGUMENTS))
    if wrong:
        raise TypeError(
            f"{where}: {wrong} are not OffloadAdamW's own arguments (these are {list(OWN_ARGUMENTS)}). torch's "
            "hyper-parameters (lr, betas, eps, weight_decay, ...) belong to ParamGroupConfig.optimizer_kwargs, and "
            "fused/foreach to OptimizersContainer.Config.implementation, as for torch.optim.AdamW.")


class OffloadOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds ``"OffloadAdamW"`` and ``"OffloadAdam"`` param groups
    (:class:`~trainstream.torch.OffloadAdamW`, :class:`~trainstream.torch.OffloadAdam`), with the groups'
    arguments and ``fused``/``foreach`` from ``implementation`` as torchtitan passes them to torch's; its other
    names (``"AdamW"``, ``"DistMuon"``, ...) build what torchtitan builds. OffloadAdamW's own arguments (``mode``,
    ``threads``, ...) go in ``optimizer_factory_kwargs_by_name["OffloadAdamW"]``. Checkpoints, LR schedulers,
    gradient clipping and hooks are torchtitan's, unchanged; the state dicts are torch's (a DCP checkpoint of
    torchtitan's AdamW loads into OffloadAdamW and back).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """``OptimizersContainer.Config``; ``ParamGroupConfig.optimizer_name`` may also be ``"OffloadAdamW"`` or
        ``"OffloadAdam"``. ``implementation='fused_opt_states_bf16'`` raises ``NotImplementedError``."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name in _FACTORIES:
            return _FACTORIES[name]
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        _check_implementation(config.implementation)
        for name in _FACTORIES:
            _check_own_arguments(config.optimizer_factory_kwargs_by_name.get(name, {}),
                                 f"optimizer_factory_kwargs_by_name[{name!r}]")
        super().__init__(config, model_parts=model_parts)

    def close(self) -> None:
        """Release every offloaded optimizer's host state and worker threads now (else at their collection)."""
        for optimizer in self.optimizers:
            if isinstance(optimizer, OffloadAdam):
                optimizer.close()


def offload_optimizers(config: OptimizersContainer.Config, **kwargs: Any) -> OffloadOptimizersContainer.Config:
    """``config`` (torchtitan's optimizer config) as an :class:`OffloadOptimizersContainer` config: each
    ``"AdamW"`` group becomes ``"OffloadAdamW"`` and each ``"Adam"`` group ``"OffloadAdam"``, with the same pattern
    and arguments; ``kwargs`` are OffloadAdamW's own arguments (``mode="hybrid"``, ``threads=8``, ...), merged over
    those the config gives ``"AdamW"``/``"Adam"`` in ``optimizer_factory_kwargs_by_name``. Other optimizers and
    every other field are kept. Raises ``NotImplementedError`` for ``implementation='fused_opt_states_bf16'`` and
    ``TypeError`` for an argument that is not OffloadAdamW's own (torch's go in the param groups), and
    ``NotImplementedError`` for ``max_grad_norm`` (torchtitan clips ``param.grad`` itself: ``training.max_norm``)."""
    _check_implementation(config.implementation)
    _check_own_arguments(kwargs, "offload_optimizers")
    groups = [replace(group, optimizer_name=RENAMES.get(group.optimizer_name, group.optimizer_name))
              for group in config.param_groups]
    by_name: dict[str, dict[str, Any]] = {}
    for name, value in config.optimizer_factory_kwargs_by_name.items():
        by_name.setdefault(RENAMES.get(name, name), {}).update(value)
    for name in RENAMES.values():
        _check_own_arguments(by_name.get(name, {}), f"optimizer_factory_kwargs_by_name[{name!r}]")
        if any(group.optimizer_name == name for group in groups):
            by_name[name] = {**by_name.get(name, {}), **kwargs}
    return derive(config, OffloadOptimizersContainer.Config, param_groups=groups,
                  optimizer_factory_kwargs_by_name=by_name)


@override(target=OptimizersContainer.Config,
          description="trainstream: AdamW/Adam with the optimizer state in host memory (OffloadAdamW)")
def offload_adamw(config: OptimizersContainer.Config, **kwargs: Any) -> OffloadOptimizersContainer.Config:
    """torchtitan override (``--override.imports trainstream.torch.torchtitan.offload_adamw``): the trainer's
    optimizer config through :func:`offload_optimizers`, with the entry's keyword arguments (JSON on the command
    line: ``'trainstream.torch.torchtitan.offload_adamw={"mode": "hybrid"}'``)."""
    return offload_optimizers(config, **kwargs)
