"""The torch.optim state-dict protocol of :class:`~trainstream.torch.OffloadAdam` (a mixin): ``state_dict`` in
torch's format (views of the host state, :mod:`._state`), ``load_state_dict`` of ours or torch's, ZeRO-1's
``consolidate_state_dict``, with torch's pre- and post-hooks. Everything is checked before anything changes."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from . import _dist as D
from . import _recipe as R
from . import _state as S

__all__ = ["Checkpoints"]


class Checkpoints:
    """State dicts of an ``OffloadAdam`` (which holds ``_slots``, ``_engine``, ``_zero``, ``_consolidated``,
    ``_state_view``, ``_gate``, ``_grads``, ``_force_decoupled`` and the torch.optim hook dicts)."""

    def state_dict(self) -> dict[str, Any]:
        """A state dict in torch's format whose tensors are views of the host state, as torch's are of its own
        (DTensors laid out as FSDP2's parameters), with torch's state-dict pre- and post-hooks. Per parameter: ``step``
        (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` (float32, the parameter's shape) and, with
        ``master_weights=True`` for fp16/bf16 parameters, ``master_param`` (the fp32 master: resuming is bit-exact).
        With ``zero_stage=1``: copies of the whole state gathered to this rank by the last
        :meth:`consolidate_state_dict` (a ``step()`` since discards them; ``RuntimeError`` without them)."""
        self._check_open("state_dict")
        if self._zero is not None and self._consolidated is None:
            raise RuntimeError(f"{type(self).__name__}(zero_stage=1).state_dict(): each rank holds only its "
                               "partition. Call consolidate_state_dict(to=rank) on every rank first, then state_dict() "
                               "on that rank (with no step() between)")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if self._zero is None:
            state_dict = self._own_state_dict()
        else:
            state_dict = {"state": {**self._consolidated["state"], **self._state_view.extras},
                          "param_groups": copy.copy(self._consolidated["param_groups"])}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _own_state_dict(self) -> dict[str, Any]:
        """This rank's state (views), keyed as torch keys it (each parameter by its first position in the groups),
        and the entries of other keys (``opt.state["key"] = ...``) as they are."""
        index: dict[int, int] = {}
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            index.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in index})
            packed["params"] = [index[id(p)] for p in g["params"]]
            start += len(packed["params"])
            groups.append(packed)
        held = [(rec.param, entry) for rec in self._slots.live() if (entry := S.entry(self._slots, rec))]
        state = {}
        for p, entry in [*held, *self._state_view.pending.items()]:
            if id(p) not in index:  # torch's state_dict raises KeyError here too
                raise KeyError(f"{type(self).__name__}.state_dict(): a parameter of shape {tuple(p.shape)} that is in "
                               "no param group has state (it was replaced in param_groups after an update, as torch's "
                               "optimizer, whose state_dict() raises KeyError too): move its entry to its replacement "
                               "(opt.state[new] = opt.state.pop(old)) or drop it (del opt.state[old])")
            state[index[id(p)]] = entry
        state.update(self._state_view.extras)
        return {"state": state, "param_groups": groups}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """``zero_stage=1``: gather every rank's partition of the state on rank ``to``, whose :meth:`state_dict` then
        returns all of it in ``torch.optim.AdamW``'s format (ZeroRedundancyOptimizer's protocol; Lightning calls it
        wherever it exists). A collective: every rank calls it. Otherwise a no-op."""
        self._check_open("consolidate_state_dict")
        if self._zero is None:
            return
        own = self._own_state_dict()
        for key in self._state_view.extras:
            own["state"].pop(key, None)
        state = D.gather_state(own["state"], to)
        self._consolidated = None if state is None else {"state": state, "param_groups": own["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of torch's optimizer (DTensor values included:
        torch.distributed.checkpoint passes it by keyword), with torch's load-state-dict pre-hooks (whose edits take
        effect) and post-hooks. The param groups become the loaded ones, as torch's (flags a saved group lacks take
        torch's defaults;
        ``OffloadAdamW``: decoupled weight decay). Everything is checked before anything changes (``ValueError``;
        ``NotImplementedError`` where a loaded group asks for other arithmetic than the parameters were registered
        with). With ``zero_stage=1`` every rank takes the whole dict and keeps its partition."""
        self._check_open("load_state_dict")
        self._sync()  # the groups' parameters as they are now, each registered
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"load_state_dict: expected a dict with 'state' and 'param_groups', got "
                             f"{type(state_dict).__name__}")
        state_dict = dict(state_dict)  # shallow copy, as torch's
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "param_groups" not in state_dict or "state" not in state_dict:
            raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}) "
                             f"than the optimizer ({len(self.param_groups)})")
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of "
                                 f"optimizer's group: group {i} has {len(sg['params'])} parameters saved, "
                                 f"{len(g['params'])} here")
        new_groups = [self._loaded_group(g, sg) for g, sg in zip(self.param_groups, saved_groups)]
        changes = [c for gi, g in enumerate(new_groups) for c in self._check_group(gi, g, list(g["params"]))]
        id_map = {}
        for sg, g in zip(saved_groups, self.param_groups):
            id_map.update(zip(sg["params"], g["params"]))
        loads, extras = {}, {}  # slot -> its state (Engine.load_state's dict); other keys: kept as they are
        for saved_id, entry in state_dict["state"].items():
            if saved_id in id_map:
                rec = self._slots.of(id_map[saved_id])
                if rec is not None:  # else another rank's (zero_stage=1)
                    loads[rec.sid] = S.parse_entry(saved_id, entry, id_map[saved_id], rec.recipe)
            elif isinstance(saved_id, int):
                raise ValueError(f"loaded state dict has state for unknown parameter id {saved_id}")
            else:
                extras[saved_id] = entry
        self._load(loads, extras)
        self._follow(changes)
        self.param_groups[:] = new_groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _loaded_group(self, group: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """A loaded group as torch makes it: the saved keys, this group's parameters (and names, if the saved group
        has none), the flags it lacks at torch's defaults (``Adam.__setstate__``; ``AdamW``'s decoupled decay)."""
        new = {**saved, "params": group["params"]}
        if "param_names" in group and "param_names" not in saved:
            new["param_names"] = group["param_names"]
        for key, value in R.FLAGS.items():
            new.setdefault(key, value)
        if self._force_decoupled:
            new["decoupled_weight_decay"] = True
        return new

    def _load(self, loads: dict[int, tuple], extras: dict[Any, Any]) -> None:
        """Give each slot its loaded state (``loads``), or fresh state where none (as torch's); ``extras``: the
        state's other keys."""
        for rec in self._slots.live():
            if rec.group is None:  # torch's state is replaced whole: that of parameters in no group goes
                self._slots.drop(rec)
        self._state_view.pending.clear()
        for rec in self._slots:
            self._slots.follow(rec)  # a replaced storage first (the masters are checked against it)
        self._consolidated = None
        engine = self._engine
        if engine is not None:
            engine.drain()
            for rec in self._slots:  # no saved state: a fresh parameter, as in torch
                rec.touched, rec.summed = rec.sid in loads, 0  # a loaded entry stays, step 0 too (torch)
                engine.load_state(rec.sid, loads.get(rec.sid) or S.fresh(D.local(rec.param).numel(), rec.recipe))
            engine.clear_error()  # every slot is consistent again
        for rec in self._slots:  # the masters follow the weights as they are now
            rec.version = D.version(rec.param)
        self._gate.clear()
        self._grads.loaded()  # the updates from hooks (and a refusal of them) went with the state
        self._state_view.extras.clear()
        self._state_view.extras.update(extras)
