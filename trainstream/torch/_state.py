"""The optimizer state as ``torch.optim.AdamW`` shows it, for :class:`~trainstream.torch.OffloadAdamW`:
``opt.state`` (:class:`StateView`), the entries of ``state_dict()`` (:func:`entry`: views of the engine's host
state, DTensors laid out as FSDP2's parameters) and the checks of an entry ``load_state_dict()`` takes
(:func:`parse_entry`). Keys: ``step``, ``exp_avg``, ``exp_avg_sq`` and, for fp16/bf16 parameters,
``master_param`` (checkpoints move to and from ``torch.optim.AdamW``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import MutableMapping
from typing import Any

import numpy as np
import torch

from . import _dist as D
from ._params import Slot, Slots

__all__ = ["StateView", "entry", "parse_entry"]


def entry(slots: Slots, rec: Slot) -> dict[str, torch.Tensor]:
    """``rec``'s ``state_dict()`` entry once its queued work has run (GPU-resident state: copies), or ``{}`` before
    its first update."""
    master, m, v, step = slots.engine.state(rec.sid, copy=False)
    if step == 0:
        return {}
    p = rec.param

    def view(a: np.ndarray) -> torch.Tensor:  # FSDP2: a DTensor laid out as the parameter
        t = torch.from_numpy(a).view(D.local(p).shape)
        return D.state_view(p, t) if D.is_dtensor(p) else t
    out = {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": view(m), "exp_avg_sq": view(v)}
    if p.dtype != torch.float32:
        out["master_param"] = view(master)
    return out


class StateView(MutableMapping):
    """``opt.state``: per updated parameter its ``state_dict()`` entry once its update has run, else ``{}`` (also for a
    tensor it does not hold, as torch's ``defaultdict``); other keys (``opt.state["note"] = ...``, as torch's hooks
    write) are kept as given (``extras``) and go into ``state_dict()`` as they are. A parameter's entry is a new
    read-only dict of views per lookup: edit its tensors in place, or use ``load_state_dict``."""

    def __init__(self, slots: Slots):
        self._slots = slots  # the registry, not the optimizer: no cycle, the optimizer stays collectable
        self.extras: dict[Any, Any] = {}

    def _rec(self, param: object) -> Slot | None:
        return None if self._slots.closed else self._slots.of(param)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, torch.Tensor):
            return self.extras[key]
        rec = self._rec(key)
        if rec is None:
            return _Entry()
        return _Entry(entry(self._slots, rec), views=not self._slots.engine.on_device(rec.sid))

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, torch.Tensor):
            raise NotImplementedError("optimizer.state[param] cannot be assigned (the state lives in the engine): edit "
                                      "its tensors in place, or use load_state_dict()")
        self.extras[key] = value

    def __delitem__(self, key: Any) -> None:
        if isinstance(key, torch.Tensor):
            raise NotImplementedError("del optimizer.state[param]: the state lives in the engine; use "
                                      "load_state_dict() with a state dict without that entry")
        del self.extras[key]

    def _stepped(self) -> list[torch.Tensor]:
        slots = self._slots
        if slots.closed or slots.engine is None:
            return []
        return [rec.param for rec in slots if slots.engine.get_step(rec.sid) > 0]

    def __iter__(self):
        return iter([*self._stepped(), *self.extras])

    def __len__(self) -> int:
        return len(self._stepped()) + len(self.extras)

    def __reduce_ex__(self, protocol: Any) -> tuple:  # copy.deepcopy, pickle: a plain dict (of copies)
        return dict, ({k: dict(v) if isinstance(v, _Entry) else v for k, v in self.items()},)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, torch.Tensor):
            return key in self.extras
        rec = self._rec(key)
        return rec is not None and self._slots.engine.get_step(rec.sid) > 0


class _Entry(dict):
    """One parameter's state as ``opt.state[param]`` shows it. Assigning a tensor of the entry's shape on the device
    the state lives on copies its values into the state (``views``: host state; else only an equal value is
    accepted); one on another device is a device move (Lightning's ``_optimizer_to_device``): the state stays
    where the optimizer keeps it. Anything else is refused (the engine would never see it)."""

    def __init__(self, values: dict | None = None, views: bool = False):
        super().__init__(values or {})
        self._views = views

    def __setitem__(self, key: Any, value: Any) -> None:
        cur = dict.get(self, key)
        if not isinstance(value, torch.Tensor) or not isinstance(cur, torch.Tensor):
            self._refuse()
        if value is cur or D.local(value).device != D.local(cur).device:
            return
        if tuple(value.shape) != tuple(cur.shape):
            raise ValueError(f"optimizer.state[param][{key!r}]: shape {tuple(value.shape)}, the state's is "
                             f"{tuple(cur.shape)}")
        if key == "step" or not self._views:
            if torch.equal(D.local(value).to(D.local(cur).dtype), D.local(cur)):
                return
            self._refuse()
        with torch.no_grad():
            cur.copy_(value)

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("optimizer.state[param] is the engine's state: edit its tensors in place "
                                  "(e.g. state['exp_avg'].zero_()), or use load_state_dict()")

    __delitem__ = update = setdefault = pop = popitem = clear = _refuse  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: Any) -> tuple:  # copy.deepcopy, pickle: a plain dict (of copies)
        return dict, (dict(self),)


def parse_entry(saved_id: Any, saved: dict[str, Any], p: torch.Tensor
                ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
    """The loaded state entry ``saved`` of parameter ``p`` (its id ``saved_id`` in the state dict), checked
    (``ValueError`` naming what is wrong): ``(exp_avg, exp_avg_sq, step, master or None)`` of this rank's part,
    flat float32. A saved fp32 master is kept only where it still rounds to the live weights (else a warning:
    one through ``torch.optim.AdamW`` is stale, and the master is re-read from the weights)."""
    if missing := [key for key in ("step", "exp_avg", "exp_avg_sq") if key not in saved]:
        raise ValueError(f"loaded state for parameter {saved_id} lacks '{missing[0]}'")
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        if key in saved and tuple(saved[key].shape) != tuple(p.shape):
            raise ValueError(f"loaded state '{key}' of parameter {saved_id} has shape "
                             f"{tuple(saved[key].shape)}, the parameter has {tuple(p.shape)}")
    step = float(saved["step"].item() if isinstance(saved["step"], torch.Tensor) else saved["step"])
    if not math.isfinite(step) or step < 0 or step != int(step):
        raise ValueError(f"loaded state of parameter {saved_id} has invalid step {step}")
    master = None
    if "master_param" in saved and p.dtype != torch.float32:
        value = D.local_value(saved["master_param"], p)
        if torch.equal(value.to(p.dtype), D.local(p).detach().to("cpu")):
            master = value.contiguous().view(-1).numpy()
        else:
            warnings.warn(f"OffloadAdamW.load_state_dict: the saved fp32 master of parameter {saved_id} does "
                          "not round to the current weights (trained further without it); re-read from the "
                          "weights", RuntimeWarning, stacklevel=3)
    m, v = (D.local_value(saved[k], p).contiguous().view(-1).numpy() for k in ("exp_avg", "exp_avg_sq"))
    return m, v, int(step), master
