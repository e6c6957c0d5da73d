"""The torch adapter's differential fuzzer (issue 40 item 5): random sequences of what training loops do to an
optimizer, each run on two worlds (a model and torch's optimizer; an equal model and ours, given the same arguments)
with the same sequence. After every ``step()`` every weight is bitwise equal (dtype included), or both raised at the
same operation, or ours refused it (``NotImplementedError`` / ``ValueError``, or a ``RuntimeError`` whose message
names our optimizer) with a message: the sequence ends there. Anything else is a finding.

Used by tests/test_fuzz_torch.py (a few hundred derandomized sequences in CI) and experiments/fuzz.py (the longer
run, with counts). A helper module, not collected by pytest.

Operations that today fail because of the param_groups defects of issue 40 items 1-3 stay here, in :data:`PENDING`
(each with its reason); :func:`op_strategy` leaves them out unless ``pending=True`` (or the environment variable
``TRAINSTREAM_FUZZ_PENDING=1``). Enable them (empty :data:`PENDING`) once the adapter handles them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import warnings
from collections import Counter
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from trainstream.torch import OffloadAdam, OffloadAdamW

#: the shapes of the model's parameter pool (the first ``n_initial`` are the optimizer's at construction; the rest are
#: spares that add_param_group or a list edit can bring in later; every one is in the model and may get gradients)
SHAPES = [(3, 4), (4,), (2, 3), (5,), (1,), (2, 2)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAIRS = {"AdamW": (OffloadAdamW, torch.optim.AdamW), "Adam": (OffloadAdam, torch.optim.Adam)}
IMPLS = {"default": {}, "foreach": {"foreach": True}, "forloop": {"foreach": False}, "fused": {"fused": True}}
LRS = [1e-3, 1e-2, 0.1]
BETAS = [(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)]
EPSS = [1e-8, 1e-6]
WDS = [0.0, 0.01, 0.1]


#: operation name -> why it is left out today (issue 40 items 1-3; the groups branch fixes them). Enable after merge.
PENDING: dict[str, str] = {}


class Finding(AssertionError):
    """A sequence whose two worlds part in a way the contract does not allow (the message says how)."""


class SilentDifference(Finding):
    """Both optimizers stepped without an error and the weights differ."""


# -- the model ----------------------------------------------------------------------------------------------------


class Pool(nn.Module):
    """Every parameter of one world; the loss of a micro-batch is a deterministic function of the parameters it
    uses (those of ``mask`` that require a gradient)."""

    def __init__(self, seed: int, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES])

    def loss(self, seed: int, mask: tuple[int, ...], scale: float) -> torch.Tensor | None:
        g = torch.Generator().manual_seed(1000 + seed)
        xs = [torch.randn(s, generator=g) for s in SHAPES]
        total = None
        for i in mask:
            p = self.ps[i]
            if not p.requires_grad:
                continue
            term = ((p.float() - xs[i]) * (p.float() + 0.5 * xs[i]).tanh()).sum() * scale
            total = term if total is None else total + term
        return total


# -- operations -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One sequence's optimizer (the same arguments for both) and model."""

    name: str = "AdamW"
    impl: str = "default"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    maximize: bool = False
    dtype: str = "float32"
    groups: tuple[tuple[int, ...], ...] = ((0, 1, 2),)  # parameter indices of each constructor group
    group_lr: tuple[float | None, ...] = (None,)  # a group's own lr (None: the default)
    seed: int = 0

    def kwargs(self) -> dict[str, Any]:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, amsgrad=self.amsgrad,
                    maximize=self.maximize, **IMPLS[self.impl])


@dataclasses.dataclass(frozen=True)
class Backward:
    """One micro-batch's ``loss.backward()`` over the parameters in ``mask`` (the others get no gradient)."""

    seed: int
    mask: tuple[int, ...]
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Clip:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (``method``: ours through
    ``opt.clip_grad_norm(max_norm, parameters=model.parameters())``); the returned norms bit for bit."""

    max_norm: float
    method: bool = False


@dataclasses.dataclass(frozen=True)
class Step:
    """``opt.step()``: then every weight is compared bit for bit."""


@dataclasses.dataclass(frozen=True)
class ZeroGrad:
    set_to_none: bool = True


@dataclasses.dataclass(frozen=True)
class Iteration:
    """One loop iteration: ``zero_grad``, ``micro`` backwards, ``clip_grad_norm_`` where ``max_norm``, ``step()``.
    ``eager``: ours' last backward inside ``opt.last_micro_batch()``, whose documented difference is that it takes
    the gradients it updates from (``param.grad`` None after it): torch's world drops the same ``param.grad`` after
    its step (:func:`run_sequence`), so that a later step or clip sees the same gradients in both. ``edit``: an
    :class:`EditState` between the backwards and the clip (the state changed before ``step()``)."""

    seed: int
    micro: int = 1
    max_norm: float | None = None
    set_to_none: bool = True
    eager: bool = False
    edit: Any = None


@dataclasses.dataclass(frozen=True)
class SetHyper:
    """``opt.param_groups[group % n][key] = value`` (a scheduler's or a user's edit)."""

    group: int
    key: str
    value: Any


@dataclasses.dataclass(frozen=True)
class AddGroup:
    """``opt.add_param_group({"params": <the next `count` spares>, **extra})`` (nothing when none is left)."""

    count: int = 1
    lr: float | None = None
    weight_decay: float | None = None


@dataclasses.dataclass(frozen=True)
class Freeze:
    """``model.ps[index].requires_grad_(flag)`` (a gradient it holds stays, as in torch)."""

    index: int
    flag: bool = False


@dataclasses.dataclass(frozen=True)
class SaveState:
    """``saved[slot] = copy.deepcopy(opt.state_dict())``."""

    slot: int = 0


@dataclasses.dataclass(frozen=True)
class LoadState:
    """``opt.load_state_dict(saved[slot])`` (a deep copy; nothing when that slot was never saved)."""

    slot: int = 0


@dataclasses.dataclass(frozen=True)
class DeepCopy:
    """``model, opt = copy.deepcopy((model, opt))``: the copies carry on (the originals closed)."""


@dataclasses.dataclass(frozen=True)
class ToDtype:
    """``model.to(dtype)`` (parameters converted in place, as nn.Module.to does)."""

    dtype: str


@dataclasses.dataclass(frozen=True)
class ReplaceParams:
    """Accelerate's swap: every parameter of group ``group % n`` replaced by a new ``nn.Parameter`` of its values, in
    the model and in the group's list; ``carry``: its state entry moved to the new one (``opt.state[new] =
    opt.state.pop(old)``), as a user who keeps the state would."""

    group: int
    carry: bool = False


@dataclasses.dataclass(frozen=True)
class HoldState:
    """``held = opt.state[<parameter index>]``: the entry kept (until a load, deep copy, dtype change or parameter
    swap, after which torch's no longer is the state), to be changed later by :class:`EditState`."""

    index: int


@dataclasses.dataclass(frozen=True)
class EditState:
    """``opt.state[p][key].mul_(factor)`` for parameter ``index`` where it has that state (``held``: through the
    entry :class:`HoldState` kept, where one is), as a user resetting or rescaling moments does."""

    index: int
    key: str
    factor: float
    held: bool = False


@dataclasses.dataclass(frozen=True)
class AppendParam:
    """``opt.param_groups[group % n]["params"].append(<the next spare>)``."""

    group: int = 0


# -- the worlds -----------------------------------------------------------------------------------------------------


class World:
    """One side: a :class:`Pool` model and its optimizer (``ours`` or torch's), the state dicts it saved."""

    def __init__(self, cfg: Config, ours: bool):
        self.ours = ours
        self.model = Pool(cfg.seed, DTYPES[cfg.dtype])
        cls = PAIRS[cfg.name][0 if ours else 1]
        groups = []
        for idx, lr in zip(cfg.groups, cfg.group_lr):
            g = {"params": [self.model.ps[i] for i in idx]}
            if lr is not None:
                g["lr"] = lr
            groups.append(g)
        kw = cfg.kwargs()
        if ours:
            kw["threads"] = 1
        self.opt = cls(groups, **kw)
        self.saved: dict[int, dict] = {}
        self.norm: torch.Tensor | None = None
        self.held: dict | None = None  # HoldState's entry

    def close(self) -> None:
        if self.ours and hasattr(self.opt, "close"):
            self.opt.close()

    def listed(self) -> set[int]:
        ids = {id(p): i for i, p in enumerate(self.model.ps)}
        return {ids[id(p)] for g in self.opt.param_groups for p in g["params"] if id(p) in ids}

    def spares(self, count: int) -> list[nn.Parameter]:
        listed = self.listed()
        return [p for i, p in enumerate(self.model.ps) if i not in listed][:count]

    def backward(self, seed: int, mask, scale: float, last: bool) -> None:
        loss = self.model.loss(seed, mask, scale)
        if loss is None:
            return
        ctx = self.opt.last_micro_batch() if (last and self.ours) else contextlib.nullcontext()
        with ctx:
            loss.backward()

    def clip(self, max_norm: float, method: bool) -> None:
        if method and self.ours:
            self.norm = self.opt.clip_grad_norm(max_norm, parameters=self.model.parameters())
        else:
            self.norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def apply(self, op) -> None:
        """Do ``op`` to this world."""
        if isinstance(op, (LoadState, DeepCopy, ToDtype, ReplaceParams)):
            self.held = None  # torch's entry is no longer its state after these
        if isinstance(op, Backward):
            self.backward(op.seed, op.mask, op.scale, False)
        elif isinstance(op, Clip):
            self.clip(op.max_norm, op.method)
        elif isinstance(op, Step):
            self.opt.step()
        elif isinstance(op, ZeroGrad):
            self.opt.zero_grad(set_to_none=op.set_to_none)
        elif isinstance(op, Iteration):
            self.opt.zero_grad(set_to_none=op.set_to_none)
            mask = tuple(range(len(SHAPES)))
            for m in range(op.micro):
                self.backward(op.seed * 7 + m, mask, 1.0 / op.micro, op.eager and m == op.micro - 1)
            if op.edit is not None:
                self.apply(op.edit)
            if op.max_norm is not None:
                self.clip(op.max_norm, False)
            self.opt.step()
        elif isinstance(op, SetHyper):
            self.opt.param_groups[op.group % len(self.opt.param_groups)][op.key] = op.value
        elif isinstance(op, AddGroup):
            params = self.spares(op.count)
            if params:
                g = {"params": params}
                if op.lr is not None:
                    g["lr"] = op.lr
                if op.weight_decay is not None:
                    g["weight_decay"] = op.weight_decay
                self.opt.add_param_group(g)
        elif isinstance(op, Freeze):
            self.model.ps[op.index].requires_grad_(op.flag)
        elif isinstance(op, SaveState):
            self.saved[op.slot] = copy.deepcopy(self.opt.state_dict())
        elif isinstance(op, LoadState):
            if op.slot in self.saved:
                self.opt.load_state_dict(copy.deepcopy(self.saved[op.slot]))
        elif isinstance(op, DeepCopy):
            old = self.opt
            self.model, self.opt = copy.deepcopy((self.model, self.opt))
            if self.ours:
                old.close()
        elif isinstance(op, ToDtype):
            self.model.to(DTYPES[op.dtype])
        elif isinstance(op, ReplaceParams):
            self._replace(op)
        elif isinstance(op, HoldState):
            p = self.model.ps[op.index]
            self.held = self.opt.state[p] if p in self.opt.state else None
        elif isinstance(op, EditState):
            p = self.model.ps[op.index]
            entry = self.held if op.held and self.held is not None else (
                self.opt.state[p] if p in self.opt.state else {})
            if op.key in entry:
                entry[op.key].mul_(op.factor)
        elif isinstance(op, AppendParam):
            params = self.spares(1)
            if params:
                self.opt.param_groups[op.group % len(self.opt.param_groups)]["params"].append(params[0])
        else:  # pragma: no cover
            raise TypeError(f"unknown operation {op!r}")

    def _replace(self, op: ReplaceParams) -> None:
        group = self.opt.param_groups[op.group % len(self.opt.param_groups)]
        index = {id(p): i for i, p in enumerate(self.model.ps)}
        new_list = []
        for p in group["params"]:
            new = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            if op.carry and p in self.opt.state:
                self.opt.state[new] = self.opt.state.pop(p)
            if id(p) in index:
                self.model.ps[index[id(p)]] = new
            new_list.append(new)
        group["params"] = new_list

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.ps]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (signed zeros compared as bits), its NaNs as 0 (their positions are compared apart: a NaN's
    own bits are not promised, docs/exactness.md)."""
    t = torch.where(t.isnan(), 0, t.detach())
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def compare(ref: World, ours: World, where: str) -> None:
    """Every weight of the two models bit for bit (dtype and shape included)."""
    for i, (a, b) in enumerate(zip(ref.weights(), ours.weights())):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise SilentDifference(f"{where}: parameter {i} is {b.dtype}{tuple(b.shape)} in ours, "
                                   f"{a.dtype}{tuple(a.shape)} in torch's")
        if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(_bits(a), _bits(b)):
            diff = (a.float() - b.float()).abs().max().item()
            raise SilentDifference(f"{where}: parameter {i} {tuple(a.shape)} {a.dtype} differs (max abs {diff:.3g})")


def _steps(op) -> bool:
    return isinstance(op, (Step, Iteration))


#: ours' exception types that are a refusal (a RuntimeError only with a message naming our optimizer)
REFUSALS = (NotImplementedError, ValueError)


def _refusal(exc: BaseException) -> str | None:
    """The reason, where ``exc`` is a refusal of ours that names why; else None."""
    msg = str(exc).strip()
    if not msg:
        return None
    named = isinstance(exc, RuntimeError) and not isinstance(exc, NotImplementedError) and "OffloadAdam" in msg
    if isinstance(exc, REFUSALS) or named:
        return f"{type(exc).__name__}: {msg}"
    return None


def reason_key(reason: str, width: int = 110) -> str:
    """A refusal's message shortened for counting (which parameter and group left out)."""
    reason = re.sub(r"\b(parameter|group) \d+", r"\1 N", reason)
    return reason if len(reason) <= width else reason[: width - 3] + "..."


def run_sequence(cfg: Config, ops: list) -> tuple[str, str]:
    """Run ``ops`` on both worlds. Returns ``(outcome, detail)``: ``("identical", "")`` (every step bitwise equal),
    ``("both raised", "<torch's type>/<our type>")``, ``("refused", reason)``, or ``("config refused", reason)``
    (ours refused the constructor's arguments torch accepted). Raises :class:`Finding` otherwise."""
    worlds = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            errs = []
            for ours in (False, True):
                try:
                    worlds.append(World(cfg, ours))
                    errs.append(None)
                except Exception as exc:  # noqa: BLE001
                    errs.append(exc)
            if errs[0] is not None and errs[1] is not None:
                return "both raised", f"{type(errs[0]).__name__}/{type(errs[1]).__name__} (constructor)"
            if errs[1] is not None:
                reason = _refusal(errs[1])
                if reason is None:
                    raise Finding(f"the constructor: ours raised {errs[1]!r} where torch's did not") from errs[1]
                return "config refused", reason
            if errs[0] is not None:
                raise Finding(f"the constructor: torch's raised {errs[0]!r}, ours did not")
            ref, ours = worlds
            for k, op in enumerate(ops):
                where = f"operation {k} {op!r}"
                e_ref = e_ours = None
                try:
                    ref.apply(op)
                except Exception as exc:  # noqa: BLE001
                    e_ref = exc
                try:
                    ours.apply(op)
                except Exception as exc:  # noqa: BLE001
                    e_ours = exc
                if e_ref is not None and e_ours is not None:
                    return "both raised", f"{type(e_ref).__name__}/{type(e_ours).__name__} ({type(op).__name__})"
                if e_ours is not None:
                    reason = _refusal(e_ours)
                    if reason is None:
                        raise Finding(f"{where}: ours raised {e_ours!r} where torch's did not") from e_ours
                    return "refused", reason
                if e_ref is not None:
                    raise Finding(f"{where}: torch's raised {e_ref!r}, ours went on") from e_ref
                if isinstance(op, Iteration) and op.eager:  # the documented difference: the gradients taken
                    for a, b in zip(ref.model.ps, ours.model.ps):
                        if b.grad is None:
                            a.grad = None
                if isinstance(op, Clip) and not torch.equal(ref.norm, ours.norm):
                    raise SilentDifference(f"{where}: the norms differ: torch {ref.norm.item()!r}, "
                                           f"ours {ours.norm.item()!r}")
                if _steps(op):
                    compare(ref, ours, f"after {where}")
            return "identical", ""
        finally:
            for w in worlds:
                w.close()


# -- strategies -----------------------------------------------------------------------------------------------------


def pending_enabled(pending: bool | None = None) -> bool:
    return os.environ.get("TRAINSTREAM_FUZZ_PENDING") == "1" if pending is None else pending


@st.composite
def configs(draw, dtypes=("float32", "float32", "float32", "bfloat16")):
    name = draw(st.sampled_from(list(PAIRS)))
    n_init = draw(st.integers(1, 4))
    split = draw(st.integers(0, n_init - 1))
    idx = tuple(range(n_init))
    groups = (idx,) if split == 0 else (idx[:split], idx[split:])
    group_lr = tuple(draw(st.sampled_from([None, None, *LRS])) for _ in groups)
    return Config(name=name, impl=draw(st.sampled_from(list(IMPLS))), lr=draw(st.sampled_from(LRS)),
                  betas=draw(st.sampled_from(BETAS)), eps=draw(st.sampled_from(EPSS)),
                  weight_decay=draw(st.sampled_from(WDS)), amsgrad=draw(st.booleans()),
                  maximize=draw(st.booleans()), dtype=draw(st.sampled_from(list(dtypes))), groups=groups,
                  group_lr=group_lr, seed=draw(st.integers(0, 3)))


def op_strategy(pending: bool | None = None, dtypes=("float32", "bfloat16", "float16")):
    """One operation; the PENDING ones only with ``pending`` (default: ``TRAINSTREAM_FUZZ_PENDING=1``)."""
    idx = st.integers(0, len(SHAPES) - 1)
    mask = st.lists(idx, min_size=1, max_size=len(SHAPES), unique=True).map(lambda xs: tuple(sorted(xs)))
    norms = st.sampled_from([0.01, 0.5, 1.0, 100.0])
    hyper = st.one_of(
        st.tuples(st.just("lr"), st.sampled_from(LRS)),
        st.tuples(st.just("weight_decay"), st.sampled_from(WDS)),
        st.tuples(st.just("betas"), st.sampled_from(BETAS)),
        st.tuples(st.just("eps"), st.sampled_from(EPSS)),
    )
    ops = _operations(idx, mask, norms, hyper, dtypes, edits(idx))
    on = pending_enabled(pending)
    return st.one_of(*[s for name, s in ops.items() if on or name not in PENDING])


def edits(idx) -> st.SearchStrategy:
    return st.builds(EditState, index=idx, key=st.sampled_from(["exp_avg", "exp_avg_sq"]),
                     factor=st.sampled_from([0.5, 2.0]), held=st.booleans())


def _operations(idx, mask, norms, hyper, dtypes, edit) -> dict[str, st.SearchStrategy]:
    return {
        "Iteration": st.builds(Iteration, seed=st.integers(0, 50), micro=st.integers(1, 3),
                               max_norm=st.one_of(st.none(), norms), set_to_none=st.booleans(),
                               eager=st.just(False), edit=st.one_of(st.none(), st.none(), edit)),
        "EagerIteration": st.builds(Iteration, seed=st.integers(0, 50), micro=st.integers(1, 3),
                                    set_to_none=st.booleans(), eager=st.just(True)),
        "EagerClip": st.builds(Iteration, seed=st.integers(0, 50), micro=st.integers(1, 3), max_norm=norms,
                               set_to_none=st.booleans(), eager=st.just(True)),
        "Step": st.just(Step()),
        "Backward": st.builds(Backward, seed=st.integers(0, 50), mask=mask, scale=st.sampled_from([1.0, 1e-3, 30.0])),
        "ZeroGrad": st.builds(ZeroGrad, set_to_none=st.booleans()),
        "Clip": st.builds(Clip, max_norm=norms, method=st.booleans()),
        "SetHyper": st.builds(lambda g, kv: SetHyper(g, *kv), st.integers(0, 2), hyper),
        "AddGroup": st.builds(AddGroup, count=st.integers(1, 2), lr=st.sampled_from([None, *LRS]),
                              weight_decay=st.sampled_from([None, *WDS])),
        "Freeze": st.builds(Freeze, index=idx, flag=st.booleans()),
        "SaveState": st.builds(SaveState, slot=st.integers(0, 1)),
        "LoadState": st.builds(LoadState, slot=st.integers(0, 1)),
        "DeepCopy": st.just(DeepCopy()),
        "ToDtype": st.builds(ToDtype, dtype=st.sampled_from(list(dtypes))),
        "ReplaceParams": st.builds(ReplaceParams, group=st.integers(0, 2), carry=st.booleans()),
        "AppendParam": st.builds(AppendParam, group=st.integers(0, 2)),
        "HoldState": st.builds(HoldState, index=idx),
        "EditState": edit,
    }


#: the names of the strategies of :func:`op_strategy` and of the sequence-level filters (PENDING's keys among them)
OPERATIONS = (*_operations(*[st.none()] * 4, (), st.none()), "DeepCopyAfterToDtype")


def _deepcopy_after_todtype(ops) -> bool:
    """A DeepCopy after a ToDtype (PENDING's ``DeepCopyAfterToDtype``)."""
    converted = False
    for op in ops:
        converted = converted or isinstance(op, ToDtype)
        if converted and isinstance(op, DeepCopy):
            return True
    return False


def sequences(pending: bool | None = None, max_ops: int = 10):
    """A list of operations (PENDING's only with ``pending``)."""
    seqs = st.lists(op_strategy(pending), min_size=1, max_size=max_ops)
    return seqs if pending_enabled(pending) else seqs.filter(lambda ops: not _deepcopy_after_todtype(ops))


def tally(counts: Counter, outcome: str, detail: str) -> None:
    counts[outcome] += 1
    if outcome in ("refused", "config refused", "both raised"):
        counts[f"{outcome}: {reason_key(detail)}"] += 1
