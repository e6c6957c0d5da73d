"""The param groups of :class:`~trainstream.torch.OffloadAdam` as torch's optimizer has them (a mixin): ``step()``
works on ``param_groups`` as they are now, whatever edited them (``add_param_group``, a list edit, Accelerate's
``fsdp2_switch_optimizer_parameters``, DTensor replacements).

At each look (:meth:`ParamGroups._sync`: ``step()``, ``last_micro_batch()``, ``load_state_dict()``) a parameter
listed for the first time is registered, with fresh state as torch would make it, or with the entry the user moved
to it (``opt.state[new] = opt.state.pop(old)``); one no longer listed loses its hooks and is never updated again,
its state kept where torch keeps it (it was updated: ``opt.state[p]`` stays until deleted) and freed otherwise.
What each group asks for (:mod:`._recipe`) is checked against what its parameters were registered with, and a
parameter with a gradient that the step would not update raises, naming it: the one legitimate skip is
``zero_stage=1``'s parameter of another rank, read from the partition.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import contract as C
from . import _params as P
from . import _recipe as R
from . import _state as S

__all__ = ["ParamGroups"]


class ParamGroups:
    """What an ``OffloadAdam`` does with its param groups (it holds ``param_groups``, ``_slots``, ``_grads``,
    ``_gate``, ``_zero``, ``_state_view``, ``_deferred``, ``master_weights`` and ``_torch_name``)."""

    def _where(self, gi: int) -> str:
        return f"{type(self).__name__} param group {gi}"

    def _name(self, gi: int, pos: int, p: torch.Tensor) -> str:
        """How messages name the parameter at position ``pos`` of group ``gi``."""
        return f"{self._where(gi)}, parameter {pos} (shape {tuple(p.shape)}, {p.dtype})"

    def _mine(self, p: torch.Tensor, gi: int | None = None, pos: int | None = None) -> bool:
        """Whether this rank holds ``p``'s state: all but zero_stage=1's parameters of other ranks, read from the
        partition; a parameter the partition lacks (listed by an edit of ``param_groups``) raises."""
        if self._zero is None:
            return True
        if p not in self._zero.owner:
            raise NotImplementedError(
                f"{self._name(gi, pos, p)} is not in zero_stage=1's partition: it was put into param_groups by an "
                "edit, which ZeRO-1 does not follow (every rank must agree on its owner). Use add_param_group.")
        return self._zero.mine(p)

    def _group_slots(self, gi: int, group: dict[str, Any], params: list[tuple[int, torch.Tensor]] | None = None
                     ) -> tuple[list[tuple[torch.Tensor, int, R.TorchRecipe]], list[str]]:
        """The ``(parameter, group index, recipe)`` of group ``gi``'s parameters this rank registers (each once;
        ``params``: only these ``(position, parameter)``), after the refusals (:func:`._recipe.refuse`,
        :func:`._recipe.unbuilt`), and how messages name each."""
        where = self._where(gi)
        R.refuse(group, where)
        impl = R.impl_of(group, group["params"])
        out, names, seen = [], [], set()
        for pos, p in enumerate(group["params"]) if params is None else params:
            if p in seen or not self._mine(p, gi, pos):
                continue
            seen.add(p)
            r = R.recipe(group, p, impl, self.master_weights)
            R.unbuilt(r, group, where)
            out.append((p, gi, r))
            names.append(self._name(gi, pos, p))
        return out, names

    def _check_group(self, gi: int, group: dict[str, Any], params: list[torch.Tensor]) -> list[tuple[P.Slot, Any]]:
        """Group ``gi`` as it is now, over ``params`` (at a step: those with a gradient), against what its registered
        parameters were built for: refused where it asks for what cannot be offered or followed. Returns the
        ``(record, recipe)`` of each parameter whose arithmetic it changes (:func:`_follow` applies them)."""
        if not params:
            return []
        where = self._where(gi)
        R.refuse(group, where)
        impl = R.impl_of(group, params)
        out = []
        for p in params:
            rec = self._slots.of(p)
            if rec is not None:  # (a parameter's own dtype or device changes are Slots.follow's to refuse)
                r = R.recipe(group, p, impl, self.master_weights)._replace(platform=rec.recipe.platform,
                                                                           dtype=rec.recipe.dtype)
                R.unbuilt(r, group, where)
                if R.changed(rec.recipe, r, where):
                    out.append((rec, r))
        return out

    def _follow(self, changes: list[tuple[P.Slot, Any]]) -> None:
        """Give each slot its group's new arithmetic (:meth:`_check_group`), as torch's next step follows an edit."""
        for rec, r in changes:
            if rec.recipe != r:
                self._slots.engine.set_recipe(rec.sid, r)
                rec.recipe = r

    def _check_groups(self) -> list[tuple[P.Slot, Any]]:
        """At ``step()``, after :meth:`_sync`: every group as it is now (edits since the last step), before anything
        changes. Every parameter with a gradient is updated by this rank or, under zero_stage=1, by its owner;
        anything else raises naming it (never a silent skip)."""
        changes, first = [], {}
        for gi, g in enumerate(self.param_groups):
            with_grad, here = [], set()
            for pos, p in enumerate(g["params"]):
                if p.grad is None:
                    continue
                seen = first.setdefault(p, gi)
                if seen != gi or p in here:
                    twice = f"that param group {seen} lists too" if seen != gi else "more than once"
                    raise NotImplementedError(
                        f"{self._where(gi)} lists a parameter {twice} (position {pos}, shape {tuple(p.shape)}): "
                        f"torch.optim.{self._torch_name} updates it once per listing (and warns or raises where the "
                        "groups are built); list each parameter once")
                here.add(p)
                with_grad.append(p)
                rec = self._slots.of(p)
                if (rec is None or rec.group != gi) and self._mine(p, gi, pos):
                    raise RuntimeError(f"{self._name(gi, pos, p)} has a gradient but is not registered with this "
                                       "optimizer; step() would not update it (a bug: please report it)")
            changes += self._check_group(gi, g, with_grad)
        return changes

    def _slot_hyper(self, rec: P.Slot) -> C.AdamWHyperParams:
        """A slot's group's hyper-parameters now, for an update started from its gradient hook (last_micro_batch)."""
        group = self.param_groups[rec.group]
        self._follow(self._check_group(rec.group, group, [rec.param]))
        return R.hyper(group)

    # -- parameters added or replaced ---------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group``; its parameters are registered now (all or none: a refusal
        leaves the optimizer as it was)."""
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)  # torch's checks and defaults (and its warning on duplicates)
        listed = list(dict.fromkeys(self.param_groups[-1]["params"]))
        zero = None if self._zero is None else self._zero.snapshot()
        try:
            if self._zero is not None:
                self._zero.add_group(listed)
            if self._deferred:  # inside __init__
                return
            self._sync()
        except BaseException:  # leave the optimizer exactly as it was (the registry unwinds itself)
            del self.param_groups[n_groups:]
            if zero is not None:
                self._zero.restore(zero)
            raise

    def _listing(self) -> dict[torch.Tensor, tuple[int, int]]:
        """Each parameter of ``param_groups`` now -> ``(group index, position)`` of its first listing."""
        listed: dict[torch.Tensor, tuple[int, int]] = {}
        for gi, g in enumerate(self.param_groups):
            params = g.get("params")
            if not isinstance(params, (list, tuple)):
                raise TypeError(f"{self._where(gi)}: 'params' must be a list of tensors, got {type(params).__name__}")
            for pos, p in enumerate(params):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"{self._where(gi)}, parameter {pos}: a {type(p).__name__}, not a tensor")
                listed.setdefault(p, (gi, pos))
        return listed

    def _sync(self) -> None:
        """Follow ``param_groups`` as they are now (module docstring): parameters that left every group stop being
        updated (hooks removed; state kept where torch keeps it, else freed), parameters back in a group continue
        with their state, new ones are registered (all or none), with a moved state entry where the user gave one."""
        slots, listed = self._slots, self._listing()
        changed = False
        for rec in slots.live():
            at = listed.get(rec.param)
            if at is None and rec.group is not None:
                self._gate.pending.discard(rec.sid)
                self._grads.done.discard(rec.sid)
                slots.leave(rec)
                changed = True
            elif at is not None:
                back, rec.group = rec.group is None, at[0]
                if back:  # its state continues, as torch's opt.state[p] does
                    self._grads.hook(rec)
        new: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for p, (gi, pos) in listed.items():
            if slots.of(p) is None and self._mine(p, gi, pos):
                new.setdefault(gi, []).append((pos, p))
        if new:
            self._register(new)
            changed = True
        if changed:
            self._gate.forget_modules()

    def _register(self, new: dict[int, list[tuple[int, torch.Tensor]]]) -> None:
        """Register the ``(position, parameter)`` lists of ``new`` (per group index), all or none, each with fresh
        state or the entry moved to it (``opt.state[p] = ...`` before it was registered: checked first)."""
        pairs, names = [], []
        for gi, params in new.items():
            more, more_names = self._group_slots(gi, self.param_groups[gi], params)
            pairs += more
            names += more_names
        pending = self._state_view.pending
        for (p, _, r), name in zip(pairs, names):
            if p in pending and not r.master:
                _check_moved(name, pending[p], p)
        loads = [S.parse_entry(name, pending[p], p, r) for (p, _, r), name in zip(pairs, names) if p in pending]
        slots = self._slots
        recs = (slots.start if slots.empty() else slots.add)(pairs, hook=self._grads.hook, names=names)
        moved = iter(loads)
        for rec in recs:
            if pending.pop(rec.param, None) is not None:
                slots.engine.load_state(rec.sid, next(moved))
                rec.touched = True


def _check_moved(name: str, entry: dict[str, Any], p: torch.Tensor) -> None:
    """A state entry moved onto ``p`` (``opt.state[p] = ...``) is taken as it is by torch's step, which raises where
    its moments are not in ``p``'s dtype: ``ValueError`` here too (no cast torch would not make)."""
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        value = entry.get(key)
        if isinstance(value, torch.Tensor) and value.dtype != p.dtype:
            raise ValueError(f"the state entry moved to {name} holds {key} in {value.dtype}, the parameter is "
                             f"{p.dtype} (torch's step raises on it): cast the entry, or del opt.state[param] for "
                             "fresh state")
