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

import weakref
from typing import Any, Callable, Iterable, NamedTuple

import torch

from .. import contract as C
from . import _dist as D
from . import _validate as V
from ._gate import Gate
from ._gradcopy import GradCopies
from ._multipliers import Multipliers, _launched_refusal, _refusal
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


class GradCapture(V.SpeculationPolicy, Multipliers):
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
        # updated from hooks, not speculatively (GPU, streamed, in place); shared with the registry (state reads)
        self.launched: dict[int, StagedCopy] = slots.launched
        self._seen: dict[int, int] = {}  # gradient hooks per slot since the last step()
        self._expect: dict[int, int] = {}  # backwards per step seen at the last step() (1 until seen otherwise)
        self._ahead: list[Slot] = []  # speculated in the last step(): their copies are taken ahead (prefetch)
        self._untrusted = False  # param.grad changed in place without moving versions (GradScaler.unscale_)
        self._scaled: dict[int, float] = {}  # fused slots' GradScaler scale their kernel divides by this step
        self._scale: float | None = None  # GradScaler's scale as last seen (a speculation assumes it)
        self._user_unscales = False  # the last GradScaler step came after GradScaler.unscale_ (param.grad unscaled)
        self._scaler = False  # GradScaler's step this step
        self._signalled = False  # Accelerate's gradient state was seen saying a micro-batch does not sync
        self.refused: str | None = None  # why updates from hooks could not follow the loop: until load_state_dict
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
        # Views of its state held (opt.state's, state_dict()'s) may be changed before step(), as torch's state may:
        # its update waits for step() then.
        held = rec.views_held()
        if engine.streamed(sid):  # bounded staging: nothing staged; under last_micro_batch() its update starts now
            if rec.once and n > 1:
                raise NotImplementedError(_second_backward(rec, sid in self.hooked))
            if hint and not held and (hp := self._hyper_now(rec)):
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
        if (hint and self._in_place and not held and not rec.sums and engine.can_speculate(sid)
                and (hp := self._hyper_now(rec))):
            self._update_in_place(rec, hp, grad)
            return
        hp = not held and self._speculates(rec, n, self.eager) and self._hyper_now(rec)
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
        return not self._last_by_signal(rec, n, exact=False)

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
        if self.refused:
            raise RuntimeError(self.refused)
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
        self._ahead = [rec for rec in self.slots if rec.sid in spec]  # they speculate at the next step too
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

    def prefetch(self) -> None:
        """After ``step()`` queued its updates: the slots that speculated in it will at the next step too, so their
        kept copies are taken ahead, while the next forward leaves the workers idle
        (:meth:`~trainstream.core._speculate.Speculative.prefetch_backups`), except where views of their state are
        held (changed in place, the copies would be stale) or their updates now run in place."""
        recs, self._ahead = self._ahead, []
        if recs and not self._in_place and self.slots.engine is not None:
            self.slots.engine.prefetch_backups([rec.sid for rec in recs if not rec.views_held()])

    def _end_step(self) -> None:
        """A step (or a skipped one) consumed this step's hooks: the backwards seen become the next step's guess."""
        self._expect.update(self._seen)
        self._seen, self.spec, self.hooked = {}, {}, set()
        self.launched.clear()
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
            self.spec, self.hooked, self._seen, self._expect = {}, set(), {}, {}
            self.launched.clear()
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
        the step's speculative updates are rolled back (exactly) and those from hooks waited for (a reload is not
        overwritten by them). Sticky: ``step()``, clipping and GradScaler raise it again until ``load_state_dict``
        (:meth:`loaded`: those updates cannot be taken twice); the next such backward speculates (``speculate=None``)."""
        if self.refused is None:
            self.slots.engine.rollback(list(self.spec))
            self.spec = {}
            self.copies.release()
            self._unguard()
            self.slots.engine.drain()
            self._in_place = self._choice is False
            self.refused = _launched_refusal(sid) if what is None else _launched_refusal(sid, what)
        return RuntimeError(self.refused)

    def loaded(self) -> None:
        """``load_state_dict`` replaced the state: this step's updates from hooks, speculative or not, and a refusal of
        them are gone with it."""
        self._end_step()
        self.refused = None

    def check_zero_grad(self) -> None:
        """``zero_grad`` before ``step()`` after a ``last_micro_batch()`` backward whose updates ran from hooks, not
        speculatively: they cannot be undone, as torch's step that is never taken changes nothing. Refused."""
        if self.launched and not self.refused and not self.slots.engine.errors.failed:
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
