"""Gradient capture for :class:`~trainstream.torch.OffloadAdamW`: the gradient hooks, the staged copies and
the multipliers torch's own clipping and unscaling apply to ``param.grad``.

As backward produces a host slot's gradient, its hook copies ``param.grad`` into the engine's staging and
records what it copied in the parameter's :class:`~trainstream.torch._params.Slot` (a :class:`StagedCopy`).
That record alone says whether the copy is still the gradient to update from: ``step()``
(:meth:`GradCapture.updates`) uses it, times the multiplier applied to ``param.grad`` since (the contract's
``c``), or copies ``param.grad`` again where it changed in another way; the engine updates what it is told.
At the backward taken to be the last before ``step()`` (under ``last_micro_batch()``, where Accelerate says so, or
as many as the last step had) a hook also starts the update at once, speculatively: ``step()`` commits it where it
is torch's bit for bit, else rolls it back and redoes it (:mod:`~trainstream.torch._validate`,
:mod:`trainstream.core._speculate`). ``param.grad`` always stays as torch leaves it.

``master_weights=True`` (a slot with ``sums``): each micro-batch's gradient is added into an fp32 sum on the host
(TrainStream 0.1.1's scheme), and ``param.grad`` holds the last micro-batch's gradient only (a hook before each
accumulation lets the next one replace it). Clipping (``max_grad_norm``, :meth:`GradCapture.clip`) and GradScaler's
unscaling inside ``step()`` act on those sums (torch's norm of them, their float32 multiplication on the host); an
in-place change of ``param.grad`` after several micro-batches cannot reach the sum and is refused at ``step()``.
With ``bounded_staging`` too (a slot with ``once``) nothing is summed: the streamed update reads the one backward's
gradient from the device, which is the scheme's sum converted to fp32; a second backward before ``step()``, clipping
the sums (``max_grad_norm``, :meth:`GradCapture.clip`) and GradScaler's unscaling of them inside ``step()`` are
refused (:func:`~trainstream.torch._params.master_refusal`), before the optimizer changes anything.
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
from . import _validate as V
from ._gate import Gate
from ._gradcopy import GradCopies
from ._params import Slot, Slots, master_refusal

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


class GradCapture(V.SpeculationPolicy):
    """The gradient side of one optimizer, over its registry ``slots``: hooks, the eager path (``eager``: inside
    ``last_micro_batch()``; ``done``: the slots it updated since the last ``step()``), the multipliers.
    ``clipping``: ``max_grad_norm`` is set (the hooks copy, never update); ``slot_hyper(record)``: its param group's
    hyper-parameters now (the group checked against what the slot was registered for). Holds nothing of the
    optimizer (its hooks hold this object weakly)."""

    def __init__(self, slots: Slots, gate: Gate, *, clipping: bool, slot_hyper: Callable[[Slot], C.AdamWHyperParams],
                 speculate: bool | None = None, grad_copies: bool | None = None):
        self.slots, self.gate, self.clipping, self.slot_hyper = slots, gate, clipping, slot_hyper
        self.eager = False
        self.hooked: set[int] = set()  # updated from hooks under last_micro_batch() (host: speculative; GPU: launched)
        self.speculate = speculate  # None: where the host memory budget allows (decided at the first one)
        self._choice = speculate  # the user's
        # Under last_micro_batch() host updates run in place, not speculatively (no copies: step() refuses a gradient
        # changed since): with speculate=False; with None once a step saw every such gradient unchanged at step().
        self._in_place = speculate is False
        self.spec: dict[int, tuple[StagedCopy, V.Assumed]] = {}  # speculated since the last step()
        self.copies = GradCopies(grad_copies)  # device copies of speculated gradients, for step()'s check
        self.uploaded: set[int] = set()  # speculated under Accelerate's signal, weights uploaded during backward
        self._guard: Any = None  # the global forward pre-hook while ``uploaded`` (:meth:`_guard_forwards`)
        self.launched: dict[int, StagedCopy] = {}  # updated from hooks, not speculatively (GPU, streamed, in place)
        self._seen: dict[int, int] = {}  # gradient hooks per slot since the last step()
        self._expect: dict[int, int] = {}  # backwards per step seen at the last step() (1 until seen otherwise)
        self._untrusted = False  # param.grad changed in place without moving versions (GradScaler.unscale_)
        self._scaled: dict[int, float] = {}  # fused slots' GradScaler scale their kernel divides by this step
        self._scale: float | None = None  # GradScaler's scale as last seen (a speculation assumes it)
        self._user_unscales = False  # the last GradScaler step came after GradScaler.unscale_ (param.grad unscaled)
        self._scaler = False  # GradScaler's step this step
        self._signalled = False  # Accelerate's gradient state was seen saying a micro-batch does not sync
        self._engine = slots.engine  # the engine the per-slot records above are of (a new one: forgotten)

    @property
    def done(self) -> set[int]:
        """The slots updated from hooks under ``last_micro_batch()`` since the last ``step()`` (checkpoints wait for
        it); none once a worker failed (a reload is how to go on)."""
        engine = self.slots.engine
        return set() if engine is None or engine.errors.failed else self.hooked

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
        """``rec``'s gradient hook. A host slot's gradient is copied into the engine's staging; where this backward
        is taken to be the last before ``step()`` (under ``last_micro_batch()``, or as many backwards as the last
        step had) its update starts from it at once, speculatively (``step()`` commits or redoes it:
        :meth:`updates`). ``param.grad`` stays. A GPU slot's kernel is launched under ``last_micro_batch()`` only."""
        self._same_engine()
        engine, p = self.slots.engine, rec.param
        on_device, hint = engine.on_device(rec.sid), self.eager and not self.clipping
        if (hint or not on_device) and _capturing(p):
            raise RuntimeError(_CAPTURED)
        if on_device:
            if hint:
                self._launch(rec)
            return  # else a GPU slot's update runs at step()
        if D.local(p).data_ptr() != rec.ptr:
            self.slots.follow(rec)  # e.g. model.double(): a clear error, not the engine's
        sid = rec.sid
        n = self._seen[sid] = self._seen.get(sid, 0) + 1
        if engine.streamed(sid):  # bounded staging: nothing staged; under last_micro_batch() its update starts now
            if rec.once and n > 1:
                raise NotImplementedError(_second_backward(rec, sid in self.hooked))
            if hint and (hp := self._hyper_now(rec)):
                self._stream(rec, hp)
            return
        if sid in self.launched:  # updated in place from this step's last_micro_batch() backward
            raise RuntimeError(f"OffloadAdamW: a second backward inside last_micro_batch() before step() (parameter "
                               f"{sid}); only the last micro-batch's backward belongs in that block: the update ran "
                               "in place from the first. Reload a checkpoint to continue.")
        if sid in self.spec:  # another backward after the one taken for the last: accumulation
            if sid in self.uploaded and engine.speculative(sid):  # no forward in between (the guard saw none)
                self._unupload()
                raise RuntimeError(f"OffloadAdamW: a second backward after the one Accelerate's gradient state marked "
                                   f"as the last micro-batch before step() (sync_gradients=True; parameter {sid}): "
                                   "the updates of that backward uploaded their weights during it, and this backward "
                                   "read them (a backward with retain_graph=True on the same forward). Take one "
                                   "backward per micro-batch there (sum the losses), or speculate=False. Reload a "
                                   "checkpoint to continue.")
            if sid in self.hooked:
                where = "inside" if self.eager else "after"
                engine.rollback([sid])
                del self.spec[sid]
                self.hooked.discard(sid)
                raise RuntimeError(f"OffloadAdamW: a second backward {where} last_micro_batch() before step() "
                                   f"(parameter {sid}); only the last micro-batch's backward belongs in that block"
                                   + ("" if self.eager else ": its weights were updated during that backward, so "
                                      "this backward's forward used them. Reload a checkpoint to continue."))
            engine.rollback([sid])  # the guess was wrong: undone exactly, before the new gradient is staged
            del self.spec[sid]
            self.copies.pop(sid)
            self.uploaded.discard(sid)
        if not self._hook_copies(p):
            return  # step() copies it
        if not hint and not rec.sums and self._not_last(rec, n):
            rec.staged = None  # the next backward adds to param.grad: a copy now would be the bytes over PCIe for nothing
            return
        grad = p.grad
        if hint and self._in_place and not rec.sums and engine.can_speculate(sid) and (hp := self._hyper_now(rec)):
            self._update_in_place(rec, hp, grad)
            return
        hp = self._speculates(rec, n, self.eager) and self._hyper_now(rec)
        if hp:
            self.slots.follow(rec)  # an edited weight is re-read before the update
            upload = self.eager or self._signalled_last()  # else at commit: a forward before step() sees old weights
            assumed = self._assume(rec, hp)
            local, dtype = self.local_grad(rec)
            kept = self.copies.keep(sid, local, self._copies_need)  # staged from the copy: the bits it holds
            try:
                engine.offload_grad(sid, local if kept is None else kept, dtype, hp, speculate=True,
                                    upload=upload, coef=assumed.coef, grad_div=assumed.grad_div)
            except NotImplementedError:  # an update the host refuses: staged only, step() raises it (nothing changed)
                self.copies.pop(sid)
                hp = None
        if hp:
            rec.staged = StagedCopy(weakref.ref(grad), D.version(grad))
            self.spec[sid] = (rec.staged, assumed)
            rec.summed = 0
            if self.eager:
                self.hooked.add(sid)
            elif upload:
                self.uploaded.add(sid)
                self._guard_forwards()
            if upload:
                self.gate.mark([sid])
            return
        engine.offload_grad(sid, *self.local_grad(rec), None, accumulate=rec.sums)
        rec.summed += rec.sums
        rec.staged = StagedCopy(weakref.ref(grad), D.version(grad))

    def _launch(self, rec: Slot) -> None:
        """Under ``last_micro_batch()``, a GPU slot's kernel from its hook (not speculative: ``step()`` refuses a
        gradient changed since, as it cannot be redone)."""
        if rec.sid in self.hooked:
            raise RuntimeError(f"OffloadAdamW: a second backward inside last_micro_batch() before step() "
                               f"(parameter {rec.sid}); only the last micro-batch's backward belongs in that block")
        hp = self.slot_hyper(rec)
        self.slots.follow(rec)
        self.hooked.add(rec.sid)
        grad = rec.param.grad
        self.slots.engine.launch_eager([(rec.sid, hp, *self.local_grad(rec, host=False))])
        self.launched[rec.sid] = StagedCopy(weakref.ref(grad), D.version(grad))
        self.gate.mark([rec.sid])

    def _not_last(self, rec: Slot, n: int) -> bool:
        """Whether another backward follows this one (the ``n``-th) before ``step()``: Accelerate's gradient state says
        this micro-batch does not sync, or without its trusted word (:meth:`_signalled_last`) the last step had more
        backwards. Its gradient is then not staged (``step()`` copies it where the guess was wrong); fp32 sums take
        every micro-batch's."""
        syncs = V._accelerate_syncs()
        if syncs is False:
            self._signalled = True
        return syncs is False or (not (syncs and self._signalled) and n < self._expect.get(rec.sid, 1))

    def _update_in_place(self, rec: Slot, hp: C.AdamWHyperParams, grad: torch.Tensor) -> None:
        """Under ``last_micro_batch()``, a host slot's update from its hook, in place: no copies kept (their DRAM
        traffic, ~12 bytes per bf16 element with the copy's reads, and their host memory), so not speculative:
        ``step()`` refuses a gradient changed since, as for a GPU slot's launch."""
        self.slots.follow(rec)  # an edited weight is re-read before the update
        self.slots.engine.offload_grad(rec.sid, *self.local_grad(rec), hp)
        rec.staged, rec.summed = None, 0
        self.hooked.add(rec.sid)
        self.launched[rec.sid] = StagedCopy(weakref.ref(grad), D.version(grad))
        self.gate.mark([rec.sid])

    def _stream(self, rec: Slot, hp: C.AdamWHyperParams) -> None:
        """Under ``last_micro_batch()``, a streamed host slot's update from its hook (bounded staging): its gradient
        read chunk by chunk as the update runs, nothing kept, so not speculative: ``step()`` refuses a gradient
        changed since, as for a GPU slot's launch."""
        if rec.sid in self.hooked:
            raise RuntimeError(f"OffloadAdamW: a second backward inside last_micro_batch() before step() "
                               f"(parameter {rec.sid}); only the last micro-batch's backward belongs in that block")
        self.slots.follow(rec)
        grad = rec.param.grad
        self.slots.engine.stream_update(rec.sid, hp, *self.local_grad(rec))
        self.hooked.add(rec.sid)
        self.launched[rec.sid] = StagedCopy(weakref.ref(grad), D.version(grad))
        self.gate.mark([rec.sid])

    # -- weights uploaded during backward under Accelerate's signal --------------------------------

    def _guard_forwards(self) -> None:
        """While speculative weights are uploaded under Accelerate's signal (``uploaded``), a forward pre-hook on
        every module (global) rolls them back before any forward reads them (:meth:`_forward_seen`)."""
        if self._guard is not None:
            return
        ref = weakref.ref(self)

        @torch.compiler.disable  # runs eagerly, outside any graph Dynamo traces
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            grads = ref()
            if grads is None or grads.slots.closed:
                handle.remove()
            elif grads.uploaded:
                grads._forward_seen(module)
        handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
        self._guard = handle

    def _forward_seen(self, module: torch.nn.Module) -> None:
        """A module's forward is about to run: where it reads weights uploaded speculatively (its parameters or its
        descendants'; a checkpointed block recomputed during backward reads none yet), every such update is rolled
        back first, the old weights uploaded again before the forward (``step()`` redoes them)."""
        mine = {id(self.slots[sid].param) for sid in self.uploaded}
        if any(id(p) in mine for p in module.parameters()):
            self._unupload()

    def _unupload(self) -> None:
        """Roll back the updates whose weights were uploaded under Accelerate's signal; the compute stream waits for
        the old weights."""
        engine, sids = self.slots.engine, [sid for sid in self.uploaded if self.slots.engine.speculative(sid)]
        self.uploaded.clear()
        self._unguard()
        for sid in sids:  # redone at step() from param.grad: no check, no copy
            self.copies.pop(sid)
        if sids:
            engine.rollback(sids)
            engine.wait_ready(sids)

    def _unguard(self) -> None:
        self.uploaded.clear()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None

    # -- step -----------------------------------------------------------------------------------

    def updates(self, groups: Iterable[dict[str, Any]], hyper: Callable[[dict[str, Any]], C.AdamWHyperParams]
                ) -> tuple[list[tuple], dict[int, float], set[int]]:
        """What ``step()`` tells the engine, per registered parameter of ``groups`` (``hyper``: a group's
        hyper-parameters) whose ``grad`` is not None: a GPU slot's gradient (not one launched from its hook); a host
        slot's staged copy (:meth:`StagedCopy.current`), times its multiplier, or ``param.grad`` copied again now. A
        speculative update is committed where it is what torch computes now (:meth:`_verdicts`), else rolled back and
        redone so (or left undone: no gradient). Returns ``(updates, coefs, early)`` for ``Engine.step``
        (``early``: the slots updated from hooks, committed); every staged copy and hook's mark is consumed."""
        self._same_engine()
        engine = self.slots.engine
        groups = list(groups)
        for rec in (self.slots.of(p) for g in groups for p in g["params"]):  # refused before anything changes
            if rec is None or rec.param.grad is None:
                continue
            if rec.sid in self.launched and not self.launched[rec.sid].current(rec.param, trusted=True):
                raise self._refuse_launched(rec.sid)
            if rec.once and self._seen.get(rec.sid, 0) > 1:
                raise NotImplementedError(_second_backward(rec, False))
            if rec.summed and rec.sid not in self.spec and (
                    rec.broken or (rec.summed > 1 and not (rec.staged and rec.staged.current(rec.param)))):
                raise RuntimeError(_refusal(rec))
        spec, launched = self.spec, self.launched
        hps = [hyper(g) for g in groups]
        holds = self._verdicts([(rec, rec.staged, *spec[rec.sid], hp) for g, hp in zip(groups, hps) for p in g["params"]
                                if (rec := self.slots.of(p)) is not None and rec.sid in spec and p.grad is not None])
        updates, coefs, commit, redone = [], {}, [], False
        # every update of this last_micro_batch() backward committed with param.grad untouched since its hook
        clean = bool(self.hooked) and not self._in_place and self._choice is None and not (
            self._untrusted or self._scaler)
        for group, hp in zip(groups, hps):
            for p in group["params"]:
                rec = self.slots.of(p)  # None: another rank's (zero_stage=1)
                if rec is None:
                    continue
                copy, rec.staged = rec.staged, None
                rec.summed, rec.broken = 0, False
                if rec.sid in spec:
                    _, assumed = spec.pop(rec.sid)
                    if holds.get(rec.sid, False):
                        commit.append(rec.sid)
                        clean = clean and (rec.sid not in self.hooked or (
                            copy is not None and copy.current(p, trusted=True) and copy.coef is None
                            and assumed.coef == 1.0 and assumed.grad_div is None))
                        continue
                    clean = False
                    engine.rollback([rec.sid])  # then redone below, from the pre-step state
                    redone = True
                if p.grad is None or rec.sid in launched:
                    continue  # no gradient: no update, as torch's
                if engine.on_device(rec.sid) or engine.streamed(rec.sid):  # the gradient as it is now
                    updates.append((rec.sid, hp, *self.local_grad(rec, host=engine.streamed(rec.sid))))
                    continue
                if copy is None or not copy.current(p, trusted=True) or self._untrusted:
                    engine.offload_grad(rec.sid, *self.local_grad(rec), None)  # changed since, or set by hand
                elif copy.coef is not None:
                    coefs[rec.sid] = copy.coef
                updates.append((rec.sid, hp))
        if spec:  # speculated, then left out of the groups: as if never updated
            engine.rollback(list(spec))
            redone = True
        if commit:
            engine.commit(commit)
            self.gate.mark(commit)
        if clean and not redone:  # the loop leaves last_micro_batch()'s gradients alone: in place from now on
            self._in_place = True
            engine.drop_backups([sid for sid in commit if sid in self.hooked])
        if commit or redone:
            engine.count_spec_step(redone)
        early = set(commit) | set(launched)
        self._end_step()
        return updates, coefs, early

    def _end_step(self) -> None:
        """A step (or a skipped one) consumed this step's hooks: the backwards seen become the next step's guess."""
        self._expect.update(self._seen)
        self._seen, self.spec, self.launched, self.hooked = {}, {}, {}, set()
        self.copies.release()
        self._unguard()
        self._untrusted, self._scaled = False, {}
        if not self._scaler:
            self._scale = None  # a step without GradScaler: the next one assumes none
        self._scaler = False

    def _same_engine(self) -> None:
        """Forget the per-slot records of an engine the registry replaced (its slot ids are not this one's; its
        speculative updates went with its state)."""
        if self.slots.engine is not self._engine:
            self._engine = self.slots.engine
            self.spec, self.launched, self.hooked, self._seen, self._expect = {}, {}, set(), {}, {}
            self.copies.release()
            self._unguard()

    def skip(self) -> None:
        """The step is skipped (GradScaler found an inf or NaN): every speculative update is rolled back, as torch's
        skipped step changes nothing."""
        self._same_engine()
        if self.spec:
            self.slots.engine.rollback(list(self.spec))
            self.slots.engine.count_spec_step(True)
            if (self.hooked or self.uploaded) and not self.gate.active:  # the old weights uploaded again: readers
                self.slots.engine.wait_step()  # wait for them (step() returns at once)
        self._end_step()

    def _refuse_launched(self, sid: int, what: str | None = None) -> RuntimeError:
        """The error for a change after a ``last_micro_batch()`` backward that an update from a hook cannot follow;
        the step's speculative updates are rolled back (exactly), its records ended (a checkpoint may be loaded), the
        updates from hooks waited for (a reload is not overwritten by them); the next such backward speculates again
        (``speculate=None``)."""
        self.slots.engine.rollback(list(self.spec))
        self._end_step()
        self._in_place = self._choice is False
        self.slots.engine.drain()
        return RuntimeError(_launched_refusal(sid) if what is None else _launched_refusal(sid, what))

    def check_zero_grad(self) -> None:
        """``zero_grad`` before ``step()`` after a ``last_micro_batch()`` backward whose updates ran from hooks, not
        speculatively: they cannot be undone, as torch's step that is never taken changes nothing. Refused."""
        if self.launched and not self.slots.engine.errors.failed:
            raise self._refuse_launched(next(iter(self.launched)), "zero_grad() before step()")

    def forget(self) -> None:
        """Drop every staged copy and sum (``zero_grad``: the engine rolls back speculative updates): ``step()``
        copies again."""
        for rec in self.slots:
            rec.staged = None
            rec.summed, rec.broken = 0, False
        self.spec, self.hooked, self._seen = {}, set(), {}
        self.copies.release()
        self._unguard()  # (the engine rolls the updates back: discard_grads)

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
        if self.launched:
            raise self._refuse_launched(next(iter(self.launched)), "clip_grad_norm()")
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
        if self.launched:
            raise self._refuse_launched(next(iter(self.launched)), "GradScaler")
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


def _second_backward(rec: Slot, updated: bool) -> str:
    """Why a second backward before ``step()`` is refused for a slot with ``once`` (``updated``: its update ran from
    the first one's hook, under ``last_micro_batch()``)."""
    after = ("Its weights were updated from the gradient of the backward inside last_micro_batch() (only the last "
             "micro-batch's backward belongs in that block): reload a checkpoint to continue." if updated else
             "Nothing of the optimizer was changed (param.grad holds both backwards' gradients, summed by torch in "
             "its dtype: zero_grad() before the next step()).")
    return master_refusal(f"a second backward before step() (parameter {rec.sid}: micro-batch accumulation)",
                          "sums the micro-batch gradients in fp32 on the host (4 bytes per parameter kept until "
                          "step()), where torch sums them into param.grad in its dtype", after,
                          ["one backward per step()"])


def _capturing(p: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (``p``: a CUDA parameter)."""
    return p.is_cuda and torch.cuda.is_current_stream_capturing()


_CAPTURED = ("OffloadAdamW: backward is being captured in a CUDA graph (torch.cuda.graph, make_graphed_callables, "
             "torch.compile(mode='reduce-overhead'), torchtitan's default training.disable_cuda_graphs=False). Gradient "
             "hooks run at capture, not at replay, so the gradients of the parameters the host updates (mode='cpu', "
             "hybrid's host share) and the updates last_micro_batch() starts would not follow the replays. Capture "
             "forward and backward without CUDA graphs (torchtitan: training.disable_cuda_graphs=True).")


def _refusal(rec: Slot, what: str = "clip_grad_norm_, GradScaler.unscale_ or by hand") -> str:
    """Why a slot's fp32 gradient sum cannot follow an in-place change of ``param.grad``."""
    return (f"OffloadAdamW(master_weights=True): param.grad of parameter {rec.sid} was changed in place ({what}) "
            "after micro-batch gradients were summed in fp32 on the host; param.grad holds only the last micro-batch's "
            "gradient, so the change cannot reach the sum. Clip with max_grad_norm= or opt.clip_grad_norm() (they "
            "clip the fp32 sums) and let GradScaler unscale inside step() (no scaler.unscale_(opt)).")
