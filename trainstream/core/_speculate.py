"""Speculative updates of host slots: an update queued from a gradient hook before the framework's ``step()`` has
said what the loop did to the gradients (clipped them, unscaled them, skipped the step, accumulated another
micro-batch, edited one in place), then committed or rolled back exactly. No torch or jax import; the adapter
decides which (it compares what the loop did with what the update assumed); this module keeps the bits.

How the pre-step state survives: *kept copies*. Each chunk of the update first copies every buffer it writes (the
weights or the fp32 weights of a float32 parameter, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) into a copy
allocated once per slot, then runs the kernel over the chunk. Where the adapter expects the next step to speculate
again, it has the copies taken *ahead* (:meth:`Speculative.prefetch_backups`): queued once the step's work on the
slot has run, behind every update, so they run while the next forward leaves the workers idle; a chunk copied ahead
is not copied again by the update (a chunk not reached yet is copied by the update, as before). Whatever writes the
slot otherwise first discards them (``_halt_precopy``: an update that is not speculative, a rollback, a reload, a
load, the state handed out as views, which the caller may change: the torch adapter neither prefetches nor updates
during backward a slot whose views are still held). (Copying in blocks of 64K elements just before the
kernel read them, from cache, cost as much DRAM time and 16 times the GIL-held calls per chunk: 9.7 us each here,
0.46 s per step of a 3B model, and a plain loop measured 2.3-2.5x the in-GPU step on an H100, experiments/RESULTS.md.) Commit costs nothing (and, where the weights' upload waited for it, uploads them: the finished updates'
together, behind one event, those still running from their last chunk);
a rollback copies them back (:meth:`Speculative.rollback`) and re-uploads the old weights where the new ones were
uploaded already. The staged gradient is only read by the update, so a redo updates from it again (times the
multiplier the loop applied) or from a new copy of the gradient.

Costs, per element of a speculated slot (``B``: the bytes of the buffers above: 12 for float32 parameters, 16 with
amsgrad; 6 for fp16/bf16 parameters with their state in their dtype, 8 with amsgrad):

* host memory: ``B`` more (the copies);
* DRAM traffic of a speculative update: ``B`` written more (plus the read-for-ownership of those lines, another
  ``B``, on CPUs without streaming stores for it), on top of the update's own (28 bytes for float32 state, 14 for
  bf16 state; the kernel re-reads the block from cache); copied ahead, ``B`` read more too, but off the update's
  path; a commit: none; a rollback: ``B`` read and ``B`` written, then the redo's update.

The alternatives, not built: weights-only speculation (new weights into a staging buffer, the state written at
commit by a second pass: no state copy, but that second pass reads the gradient and state again, +14 to +26
bytes per element on every committed step) and double buffers swapped at commit (no copy, but it needs kernels
that write their results to other buffers than they read, and the user's views of the state, ``opt.state``, would
point at the old buffers after a swap). Slots whose gradient staging the update overwrites (a master of fp16/bf16
weights, whose rounded weights are written into it) or whose gradient is an fp32 sum are never speculated
(:attr:`~trainstream.core._hostslot.HostSlot.speculable`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from ._budget import _ITEMSIZE
from ._hostslot import COPIED, COPYING, FREE, HostSlot, PreCopy, Speculation

__all__ = ["SPEC_STATS", "EngineSpeculation", "Speculation", "Speculative"]

_UNSET = object()

#: The counters (:class:`~trainstream.core._pool.Counters`): speculative updates queued, of them uploading their weights
#: at once (during backward), committed and rolled back (slots); steps whose every speculation was committed, and
#: steps with one or more rolled back (a redo); seconds lost: the rolled-back updates' own and the restores'; seconds
#: of kept copies taken by the updates themselves (``backup_s``) and ahead of them (``precopy_s``).
SPEC_STATS = ("spec_updates", "spec_uploads_early", "spec_committed", "spec_rolled_back", "spec_steps_committed",
              "spec_steps_redone", "redo_s", "backup_s", "precopy_s")
#: Copies taken ahead queue behind every update (lower priorities run first), the last slots first (backward's order).
_PRECOPY_PRIORITY = float(2 ** 52)


class Speculative:
    """The speculation methods of :class:`~trainstream.core._host.HostPlacement` (its slots, pool and counters)."""

    def speculative(self, sid: int) -> bool:
        """Whether slot ``sid`` holds a speculative update neither committed nor rolled back."""
        return self._slot(sid).spec is not None

    def can_speculate(self, sid: int) -> bool:
        """Whether slot ``sid``'s updates can be speculative (:attr:`HostSlot.speculable`)."""
        return self._slot(sid).speculable

    def backup_bytes(self, sid: int) -> int:
        """Host bytes of slot ``sid``'s kept copies (allocated at its first speculative update)."""
        return self._slot(sid).backup_bytes()

    def drop_backups(self, sid: int) -> None:
        """Free slot ``sid``'s kept copies (allocated again at its next speculative update); not while one is pending."""
        self._check_open()
        s = self._slot(sid)
        if s.spec is not None:
            raise ValueError(f"drop_backups: parameter slot {sid} holds a speculative update")
        self._halt_precopy(s)
        s.backup = None

    def prefetch_backups(self, sids: Sequence[int]) -> None:
        """Take the kept copies of slots ``sids`` ahead of their next speculative update: in the background, once
        each slot's queued work has run (the next forward's time, where the workers are idle), so that update does
        not copy them on its way (module docstring). Whatever writes a slot's buffers first (an update that is not
        speculative, a reload, a state handed out as views by ``state(copy=False)``) discards them. Slots without
        copies yet (no speculative update so far), or with a speculative update pending, are left alone."""
        self._check_open()
        if self.errors.failed:
            return
        for sid in sids:
            s = self._slot(sid)
            if s.spec is not None or s.backup is None or s.pre is not None or not s.live:
                continue
            with s.cond:
                s.pre = PreCopy(bytearray(max(1, -(-s.numel // self.chunk))))
                pre = self._due_precopy(s)
            if pre is not None:
                self._queue_precopy(s, pre)

    def staged_grad(self, sid: int) -> np.ndarray:
        """The gradient staged for slot ``sid`` (the buffer itself, float32 or the uint16 bits of fp16/bf16) once
        its copy has landed: what a speculative update read, for the adapter's bitwise check. The update may still
        run: it only reads this buffer (:attr:`HostSlot.speculable`), so the check overlaps it."""
        self._check_open()
        s = self._slot(sid)
        self.errors.check()
        if s.landed is not None:
            s.landed.synchronize()
        return s.grad_stage.array

    def guard_staged(self, sids: Sequence[int]) -> None:
        """Make the compute stream wait for the gradient copies of ``sids`` (before it changes those gradients in
        place: the copies must read them as they were)."""
        for sid in sids:
            s = self._slot(sid)
            if s.landed is not None:
                self.backend.wait_on_compute(s.landed, s.param)

    def commit(self, sids: Sequence[int]) -> None:
        """The speculative updates of ``sids`` are the step's: keep them. Weights not uploaded yet are uploaded behind
        the compute stream's work so far (one event for all): those of finished updates now, together
        (:meth:`_upload_many`), those of updates still running by their last chunk."""
        self._check_open()
        after, now = _UNSET, []
        for sid in sids:
            s = self._slot(sid)
            spec, s.spec = s.spec, None
            if spec is None:
                raise ValueError(f"commit: parameter slot {sid} holds no speculative update")
            self._stats.add("spec_committed", 1)
            if spec.upload:
                continue
            if after is _UNSET:  # the slots of a placement share one device and compute stream
                after = self.backend.record_compute(s.param)
            with s.cond:  # the update's last chunk reads ``committed`` there (HostPlacement._enqueue_update)
                if not spec.done:
                    spec.committed, spec.after = True, after
            if spec.done:
                now.append(s)
        if now:
            self._upload_many(now, after)

    def rollback(self, sids: Sequence[int]) -> None:
        """Undo the speculative updates of ``sids`` exactly (queued behind them): weights, state and step count as
        before; weights uploaded already are uploaded again. The staged gradient stays staged (``step`` updates
        from it again, or a new one replaces it). Slots without one are left as they are."""
        self._check_open()
        for sid in sids:
            self._unspeculate(self._slot(sid))

    def count_spec_step(self, redone: bool) -> None:
        """Count a step that speculated: all committed, or some redone."""
        self._stats.add("spec_steps_redone" if redone else "spec_steps_committed", 1)

    def _unspeculate(self, s: HostSlot, settle: bool = False) -> bool:
        """Roll back ``s``'s speculative update if it has one (also before its state is read, replaced or
        re-read from the weights: what the engine shows is never speculative). Returns whether its weights were
        uploaded already (they are uploaded again); with ``settle`` the compute stream waits for that
        (:meth:`_settle_uploads`: a reader of the weights may come next, e.g. after ``zero_grad`` or a state read)."""
        spec = s.spec
        if spec is None:
            return False
        self._halt_precopy(s)
        if settle:
            if self._unspeculate(s):
                self._settle_uploads([s])
            return spec.upload
        s.spec = None
        pairs = s.backed_up()
        after = self.backend.record_compute(s.param) if spec.upload else None

        def body(c: int, b: int, e: int) -> None:
            if not spec.done:  # it failed (its error is sticky: reload): the copies are partial, none is restored
                return
            if spec.upload and s.ready is not None:  # the speculative upload may still read the weights
                s.ready.synchronize()
            t = time.perf_counter()
            for live, copy in pairs:
                live[b:e] = copy[b:e]
            self._stats.add("redo_s", time.perf_counter() - t)

        def finalize() -> None:
            self._stats.add("redo_s", sum(spec.seconds))  # the rolled-back update's own time (it has run)
            if spec.upload and spec.done:
                self._upload_now(s, after)

        s.step = spec.step
        s.staged, s.summed = True, False
        self._stats.add("spec_rolled_back", 1)
        self._unwaited = True
        self._run_batch(s, body, finalize)
        return spec.upload

    # -- copies taken ahead (PreCopy: a slot's ``pre``; its chunks' states under the slot's ``cond``) --

    def _due_precopy(self, s: HostSlot) -> PreCopy | None:
        """Under ``s.cond``: ``s``'s copies taken ahead if they are to be queued now (the slot idle), marked queued."""
        pre = s.pre
        if pre is None or pre.queued or s.inflight:
            return None
        pre.queued = True
        return pre

    def _queue_precopy(self, s: HostSlot, pre: PreCopy) -> None:
        """Queue ``pre``'s copies: each chunk still :data:`FREE` while ``pre`` is the slot's is copied."""
        pairs = s.backed_up()

        def body(c: int, b: int, e: int) -> None:
            with s.cond:
                if s.pre is not pre or pre.chunks[c] != FREE or self.closed:
                    return  # discarded, taken by the update, or closing (not worth copying)
                pre.chunks[c] = COPYING
            state, t = FREE, time.perf_counter()
            try:
                for live, copy in pairs:
                    copy[b:e] = live[b:e]
                state = COPIED
            finally:
                with s.cond:
                    pre.chunks[c] = state
                    s.cond.notify_all()
            self._stats.add("precopy_s", time.perf_counter() - t)

        self._submit(s.numel, _PRECOPY_PRIORITY - s.id, None, body, None, self.errors.record, lambda: None)

    def _take_precopy(self, s: HostSlot) -> PreCopy | None:
        """A speculative update of ``s`` is queued: the copies taken ahead become its (no chunk starts any more),
        or None where none were queued."""
        with s.cond:
            pre, s.pre = s.pre, None
        return pre if pre is not None and pre.queued else None

    @staticmethod
    def _precopied(s: HostSlot, pre: PreCopy | None, c: int) -> bool:
        """In chunk ``c`` of a speculative update: whether ``pre`` copied it (waiting for a copy under way)."""
        if pre is None:
            return False
        with s.cond:
            while pre.chunks[c] == COPYING:
                s.cond.wait()
            return pre.chunks[c] == COPIED

    @staticmethod
    def _halt_precopy(s: HostSlot) -> None:
        """Before the slot's buffers are written otherwise: discard the copies taken ahead, once none is under way."""
        with s.cond:
            pre, s.pre = s.pre, None
            while pre is not None and COPYING in pre.chunks:
                s.cond.wait()

    def _settle_uploads(self, slots: Sequence[HostSlot]) -> None:
        """Wait until the weights of ``slots`` rolled back are uploaded again, and make the compute stream wait
        for them."""
        for s in slots:
            self._wait_idle(s)
            if s.ready is not None:
                self.backend.wait_on_compute(s.ready, s.param)

    def _upload_many(self, slots: Sequence[HostSlot], after: Any) -> None:
        """Upload the weights of ``slots`` (no batch of theirs queued or running) behind ``after``: through the
        backend's ``copy_many_to_device`` where it has one (one stream wait, one copy each, few events), else one
        upload each."""
        self._unwaited = True
        many = getattr(self.backend, "copy_many_to_device", None)
        if many is None:
            for s in slots:
                self._upload_now(s, after)
            return
        for s, ready in zip(slots, many([(s.param, s.upload_src) for s in slots], after)):
            s.ready = ready
            self._stats.add("param_bytes", s.numel * _ITEMSIZE[s.dtype])
        self._stats.last_finalize = time.perf_counter()

    def _upload_now(self, s: HostSlot, after: Any) -> None:
        s.ready = self.backend.copy_to_device(s.param, s.upload_src, after)
        self._stats.add("param_bytes", s.numel * _ITEMSIZE[s.dtype])
        self._stats.last_finalize = time.perf_counter()


class EngineSpeculation:
    """The speculation methods of :class:`~trainstream.core._engine.Engine`, by global slot id (host slots)."""

    def can_speculate(self, sid: int) -> bool:
        """Whether slot ``sid``'s update can be speculative (a host slot whose gradient staging the update only
        reads: not a master of fp16/bf16 weights)."""
        dev, local = self._where[self._check_sid(sid)]
        return not dev and self.host.can_speculate(local)

    def speculative(self, sid: int) -> bool:
        """Whether host slot ``sid`` holds a speculative update neither committed nor rolled back."""
        return self.host.speculative(self._local_on(sid, False))

    def speculation_bytes(self, sids: Sequence[int]) -> int:
        """Host bytes of the kept copies of ``sids`` (host slots): what speculating on them takes."""
        return sum(self.host.backup_bytes(self._local_on(sid, False)) for sid in sids)

    def drop_backups(self, sids: Sequence[int]) -> None:
        """Free the kept copies of host slots ``sids`` (none speculative now; allocated again at their next
        speculative update)."""
        for sid in sids:
            self.host.drop_backups(self._local_on(sid, False))

    def prefetch_backups(self, sids: Sequence[int]) -> None:
        """Take the kept copies of host slots ``sids`` ahead of their next speculative update, in the background
        (:meth:`Speculative.prefetch_backups`)."""
        if sids:
            self.host.prefetch_backups([self._local_on(sid, False) for sid in sids])

    def staged_grad(self, sid: int) -> np.ndarray:
        """Host slot ``sid``'s staged gradient once landed (float32, or uint16 bits), the buffer itself."""
        return self.host.staged_grad(self._local_on(sid, False))

    def guard_staged(self, sids: Sequence[int]) -> None:
        """The compute stream waits for the gradient copies of host slots ``sids`` (before an in-place change)."""
        if sids:
            self.host.guard_staged([self._local_on(sid, False) for sid in sids])

    def commit(self, sids: Sequence[int]) -> None:
        """Keep the speculative updates of host slots ``sids`` (their weights uploaded where they were not yet)."""
        if sids:
            self.host.commit([self._local_on(sid, False) for sid in sids])

    def rollback(self, sids: Sequence[int]) -> None:
        """Undo the speculative updates of host slots ``sids`` exactly; their staged gradients stay staged."""
        if sids:
            self.host.rollback([self._local_on(sid, False) for sid in sids])

    def count_spec_step(self, redone: bool) -> None:
        """Count a step that speculated (stats ``spec_steps_committed`` / ``spec_steps_redone``)."""
        self.host.count_spec_step(redone)
