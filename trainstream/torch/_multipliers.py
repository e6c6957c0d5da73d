"""The multipliers torch's clipping and GradScaler's unscaling apply to ``param.grad`` in place, followed on the host
copies (a mixin of :class:`~trainstream.torch._grads.GradCapture`): a staged copy equal to the gradient before gets
the same multiplier (the contract's ``c``), an fp32 sum is multiplied on the host as torch multiplies fp32 gradients;
and the refusals where an update already taken cannot follow such a change."""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch

from ..backends.torch import _DTYPE_NAME
from . import _dist as D
from ._params import Slot, master_refusal

__all__ = ["Multipliers"]


class Multipliers:
    """``multiply``, ``clip`` and ``amp`` of :class:`~trainstream.torch._grads.GradCapture` (its slots, records and
    refusals)."""

    def multiply(self, op: Callable[[], None], mult: dict[torch.dtype, float], sum_mult: float,
                 params: list[torch.Tensor]) -> bool:
        """Run ``op``, torch's in-place multiplication of the ``param.grad`` of ``params``; a staged copy of one of
        them equal to its gradient before gets the same multiplier ``mult[grad dtype]`` (the contract's ``c``; else,
        or on a second one: re-copied); an fp32 sum is multiplied by ``sum_mult`` on the host, in float32 as torch
        multiplies fp32 gradients. Returns whether every such sum is finite after it (GradScaler's check of them)."""
        mine = {id(p) for p in params}
        current = [rec for rec in self.slots
                   if id(rec.param) in mine and rec.staged is not None and rec.staged.current(rec.param)]
        self.slots.engine.guard_staged([rec.sid for rec in current if not self.slots.engine.on_device(rec.sid)])
        op()  # (behind the copies of the gradients it changes)
        finite = True
        for rec in current:
            grad = rec.param.grad
            if rec.summed:
                s = self.slots.engine.grad_sum(rec.sid)
                np.multiply(s, np.float32(sum_mult), out=s)
                finite = finite and bool(np.isfinite(s).all())
                rec.staged = rec.staged._replace(version=D.version(grad))
                continue
            c = mult.get(grad.dtype)
            if c is not None and rec.staged.coef is None:
                rec.staged = rec.staged._replace(version=D.version(grad), coef=c)
        return finite

    def clip(self, params: list[torch.Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool,
             foreach: bool | None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(params, ...)`` (``params``: those with a gradient) with torch's own
        functions; the staged copies get the coefficient. Returns the total norm."""
        if once := [rec for rec in map(self.slots.of, params) if rec is not None and rec.once]:
            raise NotImplementedError(master_refusal(
                f"clip_grad_norm() (parameter {once[0].sid})", "clips the fp32 gradient sums with torch's norm of "
                "them, computed on the host over whole fp32 tensors, and multiplies them by the coefficient in float32",
                instead=["torch.nn.utils.clip_grad_norm_(model.parameters(), ...), whose clipped param.grad the update "
                         "reads"]))
        if self.launched or self.refused:
            raise self._refuse_launched(next(iter(self.launched), -1), "clip_grad_norm()")
        sums = {rec.param: rec for rec in self._sums()}  # master_weights: the norm of the fp32 sums (on the host)
        grads = [torch.from_numpy(self.slots.engine.grad_sum(sums[p].sid)) if p in sums else p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        if params:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s lines
            c = float(D.local(coef))
            self.multiply(lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach),
                          {coef.dtype: c}, c, params)
        return total

    def amp(self, found_inf: torch.Tensor, scale: torch.Tensor | None, params: list[torch.Tensor]
            ) -> tuple[bool, dict[int, float]]:
        """GradScaler's ``step(opt)`` set ``found_inf`` and ``grad_scale`` (``scale``; None once the user unscaled in
        place). Returns ``(skip, grad_div)``: whether to skip the step (a fused slot's entry is made, as torch's
        fused step makes it before skipping), else the fused slots' scale (``Engine.step(grad_div=)``: their kernel
        divides), the others' ``param.grad`` (``params``: those with a gradient) unscaled as ``GradScaler.unscale_``
        does (fp32 sums: on the host; a non-finite sum GradScaler did not see skips the step, with a warning)."""
        if scale is not None and (once := [rec for rec in map(self.slots.of, params)
                                           if rec is not None and rec.once and rec.recipe.impl != "fused"]):
            raise NotImplementedError(master_refusal(
                f"GradScaler's step(optimizer) without scaler.unscale_(optimizer) first (parameter {once[0].sid})",
                "unscales the fp32 gradient sums inside step(), multiplying them by the inverse scale in float32 "
                "(param.grad's fp16/bf16 unscaling rounds)", "Nothing was changed (the step was not taken).",
                ["scaler.unscale_(optimizer) before scaler.step(optimizer) (bf16 gradients; torch refuses fp16 ones)",
                 "fused=True (its kernel divides by the scale, as the scheme's)"]))
        if self.launched or self.refused:
            raise self._refuse_launched(next(iter(self.launched), -1), "GradScaler")
        fused = [rec for rec in map(self.slots.of, params) if rec is not None and rec.recipe.impl == "fused"]
        self._scaler, self._user_unscales = True, scale is None
        if scale is not None:
            self._scale = float(scale)  # the next step's speculation assumes it
        if found_inf.item():
            for rec in fused:
                rec.touched = True
            self.skip()
            return True, {}  # skipped, as GradScaler skips torch.optim.AdamW's step
        if scale is None:  # unscaled in place by GradScaler.unscale_ (no _version change)
            if summed := [rec for rec in self.slots if rec.summed > 1]:
                raise RuntimeError(_refusal(summed[0], "GradScaler.unscale_(optimizer)"))
            for rec in self.slots:
                rec.staged = None
                rec.summed, rec.broken = 0, False
            self._untrusted = True  # speculative updates: compared bit by bit
            return False, {}
        grad_div = {rec.sid: float(scale) for rec in fused}
        self._scaled = dict(grad_div)
        params = [p for p in params if self.slots.of(p) is None or self.slots.of(p).sid not in grad_div]
        inv = scale.double().reciprocal().float()
        by_kind: dict = {}
        for grad in (D.local(p.grad) for p in params):  # a DTensor's shard: the same bits, no dispatch
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)

        def unscale():
            for (dev, _), grads in by_kind.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1, device=dev), inv.to(dev))
        if self.multiply(unscale, dict.fromkeys(_DTYPE_NAME, float(inv)), float(inv), params):  # not the fused
            return False, grad_div
        warnings.warn("OffloadAdamW(master_weights=True): an fp32 gradient sum is not finite where GradScaler's check "
                      "of param.grad (the last micro-batch's) found none; the step is skipped, as with the sums in "
                      "GPU memory, but GradScaler does not lower its scale for it", RuntimeWarning, stacklevel=4)
        return True, {}


def _launched_refusal(sid: int, what: str = "param.grad changed in place (clip_grad_norm_, GradScaler or by hand)"
                      ) -> str:
    """Why an update from a hook under ``last_micro_batch()`` (a GPU slot's kernel, a host slot's with bounded
    staging or in place) cannot follow ``what``."""
    return (f"OffloadAdamW: {what} after a last_micro_batch() backward: the update of parameter {sid} ran from its "
            "gradient as backward left it, and it is not speculative (it cannot be redone): GPU kernels of "
            "mode='gpu'/'hybrid', host updates with bounded_staging=True, and host updates with speculate=False or, "
            "with speculate=None, once a step has shown the loop leaving those gradients unchanged (in place: no "
            "copies kept). Clip with max_grad_norm= (then last_micro_batch() starts nothing early), pass "
            "speculate=True (host updates keep copies and are redone exactly), or leave last_micro_batch() out; "
            "reload a checkpoint (load_state_dict) to continue.")


def _refusal(rec: Slot, what: str = "clip_grad_norm_, GradScaler.unscale_ or by hand") -> str:
    """Why a slot's fp32 gradient sum cannot follow an in-place change of ``param.grad``."""
    return (f"OffloadAdamW(master_weights=True): param.grad of parameter {rec.sid} was changed in place ({what}) "
            "after micro-batch gradients were summed in fp32 on the host; param.grad holds only the last micro-batch's "
            "gradient, so the change cannot reach the sum. Clip with max_grad_norm= or opt.clip_grad_norm() (they "
            "clip the fp32 sums) and let GradScaler unscale inside step() (no scaler.unscale_(opt)).")
