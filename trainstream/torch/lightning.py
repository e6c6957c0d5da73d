"""Lightning's mixed-precision plugins with :class:`~trainstream.torch.OffloadAdamW` (and ``OffloadAdam``) treated as
Lightning treats ``torch.optim.AdamW`` (``Adam``) of the same ``fused`` flag (written for Lightning 2.6).

Lightning decides how to unscale and whether it may clip from an optimizer's ``_step_supports_amp_scaling``: where
it is set (torch's ``fused=True`` optimizers) it leaves GradScaler's unscaling to ``step()`` and refuses
``gradient_clip_val``, under ``"16-mixed"`` and ``"bf16-mixed"`` alike. OffloadAdamW sets it whatever ``fused`` is
(GradScaler's ``step(opt)`` then tells ``step()`` the scale, and a skipped step: both exact), so with Lightning's own
plugins a non-fused OffloadAdamW is refused ``gradient_clip_val`` where ``torch.optim.AdamW`` is not, and its
``on_before_optimizer_step`` hooks see gradients still scaled. These plugins do for a non-fused OffloadAdamW what
Lightning does for ``torch.optim.AdamW()``: under ``"16-mixed"`` ``scaler.unscale_(optimizer)`` right after the
closure (before the hooks and the clipping), then Lightning's own ``scaler.step``/``update`` (``step()`` then
learns of the unscaling and of an inf from GradScaler, as with ``unscale_`` in a plain loop); the clipping is
Lightning's (``clip_grad_norm_``/``clip_grad_value_`` over the optimizer's parameters). A ``fused=True``
OffloadAdamW, and every other optimizer, get Lightning's behaviour unchanged (as ``torch.optim.AdamW(fused=True)``).

    trainer = lightning.pytorch.Trainer(plugins=[OffloadMixedPrecision("bf16-mixed", "cuda")],  # not precision=
                                        gradient_clip_val=1.0)

Nothing else is needed for ``"32-true"``, ``"bf16-true"``, ``"16-true"``, for mixed precision without clipping, or
with ``OffloadAdamW(max_grad_norm=...)`` in place of ``gradient_clip_val`` (the same bits). The user's guide:
``docs/lightning.md``. This module imports Lightning; nothing else in trainstream does.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from ._optimizer import OffloadAdam

__all__ = ["OffloadFSDPPrecision", "OffloadMixedPrecision"]


def unscaled_as_torch(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a ``LightningOptimizer`` wraps) is an OffloadAdamW/OffloadAdam whose torch
    counterpart leaves unscaling to GradScaler: built without ``fused=True`` (torch sets
    ``_step_supports_amp_scaling`` from the constructor's ``fused``)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return isinstance(optimizer, OffloadAdam) and not optimizer.defaults.get("fused")


class _UnscaleAsTorch:
    """The two hooks of a Lightning precision plugin that depend on ``_step_supports_amp_scaling``."""

    scaler: Any

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Lightning's ``optimizer_step``; for a non-fused OffloadAdamW under a scaler, the closure is followed by
        ``scaler.unscale_(optimizer)`` where Lightning would call it for ``torch.optim.AdamW`` (not after a skipped
        backward in automatic optimization: Lightning then skips ``scaler.step`` too)."""
        if self.scaler is not None and unscaled_as_torch(optimizer):
            run = closure

            def closure() -> Any:
                result = run()
                if result is not None or not model.automatic_optimization:
                    self.scaler.unscale_(optimizer)
                return result
        return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Lightning's clipping, not refused for a non-fused OffloadAdamW: the gradients Lightning clips for
        ``torch.optim.AdamW`` (unscaled after the closure; in manual optimization, before ``step()``, as they are)."""
        if unscaled_as_torch(optimizer):
            return Precision.clip_gradients(self, optimizer, clip_val,  # type: ignore[arg-type]
                                            gradient_clip_algorithm)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]


class OffloadMixedPrecision(_UnscaleAsTorch, MixedPrecision):
    """Lightning's ``MixedPrecision`` (``precision="16-mixed"``/``"bf16-mixed"``, its arguments: ``precision``,
    ``device``, ``scaler``) with a non-fused OffloadAdamW treated as ``torch.optim.AdamW``: pass it as
    ``Trainer(plugins=[OffloadMixedPrecision("bf16-mixed", "cuda")])`` in place of ``precision="bf16-mixed"``."""


class OffloadFSDPPrecision(_UnscaleAsTorch, FSDPPrecision):
    """Lightning's ``FSDPPrecision`` (``FSDPStrategy``'s; its arguments: ``precision``, ``scaler``) with a non-fused
    OffloadAdamW treated as ``torch.optim.AdamW``: under ``"16-mixed"`` its ``ShardedGradScaler`` unscales before
    the hooks and ``gradient_clip_algorithm="value"`` (Lightning's FSDP plugin refuses norm clipping for every
    optimizer). Pass it as ``Trainer(strategy=FSDPStrategy(...), plugins=[OffloadFSDPPrecision("16-mixed")])``
    in place of ``precision="16-mixed"``."""
