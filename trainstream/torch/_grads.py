"""Gradient capture for :class:`~trainstream.torch.OffloadAdamW`: the gradient hooks, the staged copies and
the multipliers torch's own clipping and unscaling apply to ``param.grad``.

As backward produces a host slot's gradient, its hook copies ``param.grad`` into the engine's staging and
records what it copied in the parameter's :class:`~trainstream.torch._params.Slot` (a :class:`StagedCopy`).
That record alone says whether the copy is still the gradient to update from: ``step()``
(:meth:`GradCapture.updates`) uses it, times the multiplier applied to ``param.grad`` since (the contract's
``c``), or copies ``param.grad`` again where it changed in another way; the engine updates what it is told.
Under ``last_micro_batch()`` (the eager path) a hook takes the gradient and starts its update at once.

``master_weights=True`` (a slot with ``sums``): each micro-batch's gradient is added into an fp32 sum on the host
(TrainStream 0.1.1's scheme), and ``param.grad`` holds the last micro-batch's gradient only (a hook before each
accumulation lets the next one replace it). Clipping (``max_grad_norm``, :meth:`GradCapture.clip`) and GradScaler's
unscaling inside ``step()`` act on those sums (torch's norm of them, their float32 multiplication on the host); an
in-place change of ``param.grad`` after several micro-batches cannot reach the sum and is refused at ``step()``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import torch

from .. import contract as C
from ..backends.torch import _DTYPE_NAME
from . import _dist as D
from ._gate import Gate
from ._params import Slot, Slots

__all__ = ["GradCapture", "StagedCopy"]


class StagedCopy(NamedTuple):
    """What a hook copied into the engine's staging: the gradient tensor, its version counter then (or after
    the one multiplication since) and that multiplication's factor (None: none)."""

    grad: weakref.ref
    version: Any
    coef: float | None = None

    def current(self, p: torch.Tensor, trusted: bool = False) -> bool:
        """Whether ``p.grad`` is the tensor copied, at that version; with ``trusted`` also, for a DTensor whose
        in-place foreach ops move no version counter, multiplied since by this one alone."""
        grad = p.grad
        if grad is None or self.grad() is not grad or self.version != D.version(grad):
            return False
        return not trusted or self.coef is not None or not D.is_dtensor(p) or D.foreach_moves_versions(p.device_mesh)


class GradCapture:
    """The gradient side of one optimizer, over its registry ``slots``: hooks, the eager path (``eager``: inside
    ``last_micro_batch()``; ``done``: the slots it updated since the last ``step()``), the multipliers.
    ``clipping``: ``max_grad_norm`` is set (the hooks copy, never update); ``slot_hyper(record)``: its param group's
    hyper-parameters now (the group checked against what the slot was registered for). Holds nothing of the
    optimizer (its hooks hold this object weakly)."""

    def __init__(self, slots: Slots, gate: Gate, *, clipping: bool, slot_hyper: Callable[[Slot], C.AdamWHyperParams]):
        self.slots, self.gate, self.clipping, self.slot_hyper = slots, gate, clipping, slot_hyper
        self.eager = False
        self.done: set[int] = set()

    # -- hooks ----------------------------------------------------------------------------------

    def hook(self, rec: Slot, gpu: bool = False) -> None:
        """Give trainable slot ``rec`` its gradient hook (:meth:`_ready`) once; ``gpu``: a GPU slot's (eager)."""
        if self.slots.engine.on_device(rec.sid) != gpu or not rec.param.requires_grad:
            return
        if (rec.gpu_hook if gpu else rec.hook) is not None:
            return
        ref, sid = weakref.ref(self), rec.sid  # no cycle through the parameter's hooks

        def hook(param: torch.Tensor) -> None:
            grads = ref()
            if grads is not None and not grads.slots.closed and param.grad is not None:
                grads._ready(grads.slots[sid])
        handle = rec.param.register_post_accumulate_grad_hook(hook)
        if gpu:
            rec.gpu_hook = handle
            return
        rec.hook = handle
        if rec.sums and rec.pre_hook is None:
            def before(grad: torch.Tensor) -> None:
                grads = ref()
                if grads is not None and not grads.slots.closed:
                    grads._before(grads.slots[sid])
            rec.pre_hook = rec.param.register_hook(before)

    @staticmethod
    def _before(rec: Slot) -> None:
        """A slot with sums, as autograd is about to accumulate the next micro-batch's gradient: ``param.grad`` (added
        into the fp32 sum already) makes way for it; one changed in place since cannot, and ``step()`` refuses."""
        p = rec.param
        if rec.summed and p.grad is not None:
            if rec.staged is not None and rec.staged.current(p):
                p.grad = None
            else:
                rec.broken = True

    def _ready(self, rec: Slot) -> None:
        """``rec``'s gradient hook: under ``last_micro_batch()`` (no clipping) take the gradient and start its
        update (behind its copy; a GPU slot's kernel behind backward), else copy a host slot's gradient for step()."""
        engine, p = self.slots.engine, rec.param
        on_device, eager = engine.on_device(rec.sid), self.eager and not self.clipping
        if on_device and not eager:
            return  # a GPU slot's update runs at step()
        if D.local(p).data_ptr() != rec.ptr:
            self.slots.follow(rec)  # e.g. model.double(): a clear error, not the engine's
        if eager:
            rec.staged = None
            if rec.sid in self.done:
                raise RuntimeError(f"OffloadAdamW: a second backward inside last_micro_batch() before step() "
                                   f"(parameter {rec.sid}); only the last micro-batch's backward belongs in that block")
            hp = self.slot_hyper(rec)  # first: a group edit it cannot follow raises before anything changes
            self.slots.follow(rec)  # an edited weight is re-read before the update
            self.done.add(rec.sid)
            if on_device:
                engine.launch_eager([(rec.sid, hp, *self.local_grad(rec, host=False))])
            else:
                if rec.broken:
                    raise RuntimeError(_refusal(rec))
                engine.offload_grad(rec.sid, *self.local_grad(rec), hp, accumulate=rec.sums)
                rec.summed = 0
            self.gate.mark([rec.sid])
            p.grad = None  # taken: the engine keeps it alive until read (an in-place change would race the update)
        elif self._hook_copies(p):  # else step() copies it
            grad = p.grad
            engine.offload_grad(rec.sid, *self.local_grad(rec), None, accumulate=rec.sums)
            rec.summed += rec.sums
            rec.staged = StagedCopy(weakref.ref(grad), D.version(grad))

    def _hook_copies(self, p: torch.Tensor) -> bool:
        """Whether the hook copies ``p.grad`` for ``step()``: not for a plain parameter with several processes (reduced
        later); for a DTensor if foreach ops move version counters or ``max_grad_norm`` (applied to the copy) is set."""
        if D.is_dtensor(p):
            return self.clipping or D.foreach_moves_versions(p.device_mesh)
        return D.world()[1] == 1

    @staticmethod
    def local_grad(rec: Slot, host: bool = True) -> tuple[torch.Tensor, str]:
        """``param.grad``'s local tensor, detached and contiguous (flat with ``host=False``: GPU slots), and its dtype's
        name; refuses a sparse gradient, one on another device than the parameter, for a host slot another dtype or
        shape."""
        p, sid = rec.param, rec.sid
        grad, loc = D.local(p.grad), D.local(p)
        if grad.is_sparse:
            raise RuntimeError(f"OffloadAdamW does not support sparse gradients (parameter {sid})")
        if host and (grad.dtype != loc.dtype or grad.shape != loc.shape):
            raise TypeError(f"OffloadAdamW: gradient of parameter {sid} is {grad.dtype}{tuple(grad.shape)}, the "
                            f"parameter is {loc.dtype}{tuple(loc.shape)}" + (" (local shards)" if loc is not p else ""))
        if grad.device != loc.device:
            raise ValueError(f"OffloadAdamW: parameter {sid} is on {loc.device}, its gradient on {grad.device}")
        if grad.dtype not in _DTYPE_NAME:
            raise TypeError(f"OffloadAdamW: gradient of parameter {sid} has unsupported dtype {grad.dtype}")
        if not host:
            return grad.detach().contiguous().view(-1), _DTYPE_NAME[grad.dtype]
        # Only the torch calls needed: each releases and retakes the GIL, costly under busy workers.
        if grad.requires_grad:
            grad = grad.detach()
        if not grad.is_contiguous():
            grad = grad.contiguous()
        return grad, _DTYPE_NAME[grad.dtype]

    # -- step -----------------------------------------------------------------------------------

    def updates(self, groups: Iterable[dict[str, Any]], hyper: Callable[[dict[str, Any]], C.AdamWHyperParams]
                ) -> tuple[list[tuple], dict[int, float], set[int]]:
        """What ``step()`` tells the engine, per registered parameter of ``groups`` (``hyper``: a group's
        hyper-parameters) whose ``grad`` is not None and that no eager update took: a GPU slot's gradient; a host
        slot's staged copy (:meth:`StagedCopy.current`), times its multiplier, or ``param.grad`` copied again now.
        Returns ``(updates, coefs, eager)`` for ``Engine.step`` (``eager``: the slots updated from hooks); every
        staged copy and eager mark is consumed."""
        engine, eager = self.slots.engine, self.done
        groups = list(groups)
        for rec in (self.slots.of(p) for g in groups for p in g["params"]):  # refused before anything changes
            if rec is not None and rec.summed and rec.sid not in eager and rec.param.grad is not None and (
                    rec.broken or (rec.summed > 1 and not (rec.staged and rec.staged.current(rec.param)))):
                raise RuntimeError(_refusal(rec))
        self.done = set()
        updates, coefs = [], {}
        for group in groups:
            hp = hyper(group)
            for p in group["params"]:
                rec = self.slots.of(p)  # None: another rank's (zero_stage=1)
                if rec is None:
                    continue
                copy, rec.staged = rec.staged, None
                rec.summed, rec.broken = 0, False
                if p.grad is None or rec.sid in eager:
                    continue  # no gradient: no update, as torch's
                if engine.on_device(rec.sid):
                    updates.append((rec.sid, hp, *self.local_grad(rec, host=False)))
                    continue
                if copy is None or not copy.current(p, trusted=True):
                    engine.offload_grad(rec.sid, *self.local_grad(rec), None)  # changed since, or set by hand
                elif copy.coef is not None:
                    coefs[rec.sid] = copy.coef
                updates.append((rec.sid, hp))
        return updates, coefs, eager

    def forget(self) -> None:
        """Drop every staged copy and sum (``zero_grad``, or gradients unscaled in place): ``step()`` copies again."""
        for rec in self.slots:
            rec.staged = None
            rec.summed, rec.broken = 0, False

    def _sums(self) -> list[Slot]:
        """The slots whose staged gradient is an fp32 sum still equal to the micro-batches' (param.grad unchanged)."""
        return [rec for rec in self.slots if rec.summed and not rec.broken and rec.staged is not None
                and rec.staged.current(rec.param)]

    # -- multipliers: torch's clipping and unscaling of param.grad, the same c on the copies --------------------

    def multiply(self, op: Callable[[], None], mult: dict[torch.dtype, float], sum_mult: float,
                 params: list[torch.Tensor]) -> bool:
        """Run ``op``, torch's in-place multiplication of the ``param.grad`` of ``params``; a staged copy of one of
        them equal to its gradient before gets the same multiplier ``mult[grad dtype]`` (the contract's ``c``; else,
        or on a second one: re-copied); an fp32 sum is multiplied by ``sum_mult`` on the host, in float32 as torch
        multiplies fp32 gradients. Returns whether every such sum is finite after it (GradScaler's check of them)."""
        mine = {id(p) for p in params}
        current = [rec for rec in self.slots
                   if id(rec.param) in mine and rec.staged is not None and rec.staged.current(rec.param)]
        op()
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
        if self.done:
            raise RuntimeError("OffloadAdamW.clip_grad_norm() after a last_micro_batch() backward: its gradients "
                               "were taken by their updates (use max_grad_norm=, which turns the eager path off)")
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
        if self.done:
            raise RuntimeError("OffloadAdamW: GradScaler with last_micro_batch(): the updates used the scaled "
                               "gradients. Use one or the other; reload a checkpoint (load_state_dict) to continue.")
        fused = [rec for rec in map(self.slots.of, params) if rec is not None and rec.recipe.impl == "fused"]
        if found_inf.item():
            for rec in fused:
                rec.touched = True
            return True, {}  # skipped, as GradScaler skips torch.optim.AdamW's step
        if scale is None:  # unscaled in place by GradScaler.unscale_ (no _version change)
            if summed := [rec for rec in self.slots if rec.summed > 1]:
                raise RuntimeError(_refusal(summed[0], "GradScaler.unscale_(optimizer)"))
            self.forget()
            return False, {}
        grad_div = {rec.sid: float(scale) for rec in fused}
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


def _refusal(rec: Slot, what: str = "clip_grad_norm_, GradScaler.unscale_ or by hand") -> str:
    """Why a slot's fp32 gradient sum cannot follow an in-place change of ``param.grad``."""
    return (f"OffloadAdamW(master_weights=True): param.grad of parameter {rec.sid} was changed in place ({what}) "
            "after micro-batch gradients were summed in fp32 on the host; param.grad holds only the last micro-batch's "
            "gradient, so the change cannot reach the sum. Clip with max_grad_norm= or opt.clip_grad_norm() (they "
            "clip the fp32 sums) and let GradScaler unscale inside step() (no scaler.unscale_(opt)).")
