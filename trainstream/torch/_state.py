"""The optimizer state as ``torch.optim.AdamW`` shows it, for :class:`~trainstream.torch.OffloadAdamW`:
``opt.state`` (:class:`StateView`), the entries of ``state_dict()`` (:func:`entry`: views of the engine's host
state, DTensors laid out as FSDP2's parameters) and the checks of an entry ``load_state_dict()`` takes
(:func:`parse_entry`). Keys as torch's: ``step``, ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad) in
the parameter's dtype, and with ``master_weights=True`` float32 moments and ``master_param`` for fp16/bf16 parameters
(checkpoints move to and from ``torch.optim.AdamW`` both ways, for both schemes).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from .. import contract as C
from ..backends.torch import _TORCH_DTYPE
from . import _dist as D
from ._params import Slot, Slots

__all__ = ["StateView", "entry", "fresh", "parse_entry"]


#: The engine's state keys -> torch's state-dict keys.
_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq",
         "master": "master_param"}


def _tensor(a: np.ndarray, dtype: str, held: list) -> torch.Tensor:
    """A flat host state array as a tensor of ``dtype`` sharing its memory (uint16 bits: an fp16/bf16 view); appends
    to ``held`` a weak reference that lives as long as any tensor or array sharing that memory through it (the NumPy
    view that the tensor's storage keeps alive: its views, ``.data``, ``.detach()``, ``.numpy()`` too)."""
    v = a.view(np.int16) if a.dtype == np.uint16 else a.view()  # a new object per call: its own lifetime
    held.append(weakref.ref(v))
    t = torch.from_numpy(v)
    return t.view(_TORCH_DTYPE[dtype]) if a.dtype == np.uint16 else t


def entry(slots: Slots, rec: Slot) -> dict[str, torch.Tensor]:
    """``rec``'s ``state_dict()`` entry once its queued work has run (GPU-resident state: copies), or ``{}`` before
    its first update (as torch's, whose fused implementation makes the entry at a step GradScaler skips:
    ``rec.touched``). Keys as torch's: ``step`` (a float32 scalar tensor; fused: on the parameter's device),
    ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad) in the state dtype (the parameter's, or float32
    with ``master_weights=True``), and a master's ``master_param`` (float32); views of the host state."""
    if rec.sid in slots.launched:
        raise RuntimeError(
            f"OffloadAdamW: the state of parameter {rec.sid} was read between a backward inside last_micro_batch() and "
            "step(): its update ran during that backward and is kept as it is (in place, without a copy of the "
            "pre-step state: speculate=None after a step that left the gradients alone, or speculate=False; or on the "
            "GPU), so the pre-step state torch shows here is gone. Read it after step(), or pass speculate=True "
            "(copies kept: a read sees the pre-step state).")
    st = slots.engine.state(rec.sid, copy=False)
    rec.views_held()  # drops the references of views gone (a GPU slot's are never looked at otherwise)
    if st["step"] == 0 and not rec.touched:
        return {}
    p, r = rec.param, rec.recipe
    sd = C.state_dtype(r)

    def view(key: str, a: np.ndarray) -> torch.Tensor:  # FSDP2: a DTensor laid out as the parameter
        t = _tensor(a, "float32" if key == "master" else sd, rec.views).view(D.local(p).shape)
        return D.state_view(p, t) if D.is_dtensor(p) else t
    device = D.local(p).device if r.impl == "fused" else "cpu"  # torch keeps a fused step on the device
    out = {"step": torch.tensor(float(st["step"]), dtype=torch.float32, device=device)}
    out.update({_KEYS[k]: view(k, st[k]) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master") if k in st})
    return out


class StateView(MutableMapping):
    """``opt.state``: per updated parameter its ``state_dict()`` entry once its update has run, else ``{}`` (also for a
    tensor it does not hold, as torch's ``defaultdict``); other keys (``opt.state["note"] = ...``, as torch's hooks
    write) are kept as given (``extras``) and go into ``state_dict()`` as they are. A parameter's entry is a new
    read-only dict of views per lookup: edit its tensors in place, or use ``load_state_dict``.

    A parameter's entry moves as in torch: ``opt.state[new] = opt.state.pop(old)`` (``pop`` returns copies); ``new``
    not updated yet takes it (``pending`` until it is registered, at the next step). ``del opt.state[p]`` makes
    ``p``'s state fresh (torch's next step starts it again), or frees it where ``p`` left every group. Replacing the
    entry of a parameter that has state is refused (delete it first)."""

    def __init__(self, slots: Slots):
        self._slots = slots  # the registry, not the optimizer: no cycle, the optimizer stays collectable
        self.extras: dict[Any, Any] = {}
        self.pending: dict[torch.Tensor, dict] = {}  # entries moved to parameters not registered yet

    def _rec(self, param: object) -> Slot | None:
        return None if self._slots.closed else self._slots.of(param)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, torch.Tensor):
            return self.extras[key]
        rec = self._rec(key)
        if rec is None:
            return self.pending[key] if key in self.pending else _Entry()
        return _Entry(entry(self._slots, rec), views=not self._slots.engine.on_device(rec.sid))

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(key, torch.Tensor):
            self.extras[key] = value
            return
        rec = self._rec(key)
        if not isinstance(value, Mapping) or (rec is not None and rec.holds_state(self._slots.engine)):
            raise NotImplementedError(
                "optimizer.state[param] cannot be replaced (the state lives in the engine): edit its tensors in place, "
                "use load_state_dict(), or move an entry to a parameter without state: "
                "opt.state[new] = opt.state.pop(old)")
        if rec is None:  # registered at the next step, with it
            self.pending.pop(key, None)
            if value:
                self.pending[key] = dict(value)
        elif value:  # registered, fresh: it takes the entry now
            self._slots.engine.load_state(rec.sid, parse_entry(rec.sid, value, key, rec.recipe))
            rec.touched = True

    def __delitem__(self, key: Any) -> None:
        if not isinstance(key, torch.Tensor):
            del self.extras[key]
            return
        rec = self._rec(key)
        if rec is None or not rec.holds_state(self._slots.engine):
            if key not in self.pending:
                raise KeyError(key)
            del self.pending[key]
        elif rec.group is None:  # it left every group: freed
            self._slots.drop(rec)
        else:  # fresh from the next step, as torch's
            self._slots.engine.load_state(rec.sid, fresh(D.local(rec.param).numel(), rec.recipe))
            rec.touched = False

    def pop(self, key: Any, *default: Any) -> Any:
        """``opt.state.pop(p)``: copies of ``p``'s entry (the state itself becomes fresh, or is freed)."""
        if isinstance(key, torch.Tensor) and key in self:
            value = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self[key].items()}
            del self[key]
            return value
        return super().pop(key, *default)

    def _stepped(self) -> list[torch.Tensor]:
        slots = self._slots
        if slots.closed or slots.engine is None:
            return []
        return [rec.param for rec in slots.live() if rec.holds_state(slots.engine)]

    def __iter__(self):
        return iter([*self._stepped(), *self.pending, *self.extras])

    def __len__(self) -> int:
        return len(self._stepped()) + len(self.pending) + len(self.extras)

    def __reduce_ex__(self, protocol: Any) -> tuple:  # copy.deepcopy, pickle: a plain dict (of copies)
        return dict, ({k: dict(v) if isinstance(v, _Entry) else v for k, v in self.items()},)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, torch.Tensor):
            return key in self.extras
        rec = self._rec(key)
        return key in self.pending if rec is None else rec.holds_state(self._slots.engine)


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


def parse_entry(saved_id: Any, saved: dict[str, Any], p: torch.Tensor, recipe: C.TorchRecipe) -> dict[str, Any]:
    """The loaded state entry ``saved`` of parameter ``p`` (its id ``saved_id`` in the state dict) of ``recipe``,
    checked (``ValueError`` naming what is wrong), as ``Engine.load_state`` takes it: this rank's part, flat, cast to
    the state dtype as torch's ``load_state_dict`` casts state to the parameter's dtype (fp16/bf16: their bits); from
    or for either scheme (an fp32 master's state loads into torch's fp16/bf16 state and back). A saved fp32 master is
    kept only where it still rounds to the live weights (else a warning: one through ``torch.optim.AdamW`` is stale,
    and the master is re-read from the weights)."""
    need = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if recipe.amsgrad else ())
    if missing := [key for key in need if key not in saved]:
        extra = " (amsgrad=True: a checkpoint of amsgrad=False lacks it)" if missing[0] == "max_exp_avg_sq" else ""
        raise ValueError(f"loaded state for parameter {saved_id} lacks '{missing[0]}'{extra}")
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
        if key in saved and tuple(saved[key].shape) != tuple(p.shape):
            raise ValueError(f"loaded state '{key}' of parameter {saved_id} has shape "
                             f"{tuple(saved[key].shape)}, the parameter has {tuple(p.shape)}")
    step = float(saved["step"].item() if isinstance(saved["step"], torch.Tensor) else saved["step"])
    if not math.isfinite(step) or step < 0 or step != int(step):
        raise ValueError(f"loaded state of parameter {saved_id} has invalid step {step}")
    sd = _TORCH_DTYPE[C.state_dtype(recipe)]
    out: dict[str, Any] = {"step": int(step)}
    for key in need[1:]:
        out[key] = _array(D.local_value(saved[key], p).to(sd))
    if "master_param" in saved and recipe.master:
        value = D.local_value(saved["master_param"], p).to(torch.float32)
        if torch.equal(value.to(p.dtype), D.local(p).detach().to("cpu")):
            out["master"] = _array(value)
        else:
            warnings.warn(f"OffloadAdamW.load_state_dict: the saved fp32 master of parameter {saved_id} does "
                          "not round to the current weights (trained further without it); re-read from the "
                          "weights", RuntimeWarning, stacklevel=3)
    return out


def fresh(numel: int, recipe: C.TorchRecipe) -> dict[str, Any]:
    """The state of a parameter without saved state (as torch's): step 0, zero moments."""
    zeros = np.zeros(numel, np.float32)
    return {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros, **({"max_exp_avg_sq": zeros} if recipe.amsgrad else {})}


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values, flat: float32, or the uint16 bits of fp16/bf16."""
    t = t.contiguous().view(-1)
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
