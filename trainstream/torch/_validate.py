"""Speculation's policy for :class:`~trainstream.torch._grads.GradCapture` (:class:`SpeculationPolicy`: at which
backward a hook starts the update, what it assumes, whether the host memory budget allows it) and its
validation at ``step()``: whether the update a gradient hook started (from the gradient it staged, times the
multiplier it assumed, divided by the GradScaler scale it assumed, with the hyper-parameters of its group then)
is bit for bit the update torch.optim.AdamW computes now. Detected, not assumed:

* ``param.grad`` is the tensor staged, at the same ``_version``: the multiplier torch's clipping or GradScaler's
  unscaling applied through this optimizer (``StagedCopy.coef``, else 1.0) and the scale its fused kernels
  divide by must be the ones assumed;
* else (the version moved: the loop's own ``clip_grad_norm_``, which multiplies even by 1.0, an edit by hand; or
  GradScaler's ``unscale_``, which moves no version): ``param.grad``'s bits must equal the staged gradient times
  the assumed multiplier, rounded as torch rounds it (the staged bits themselves for 1.0), compared on the
  gradient's device: against the copy its hook kept there (:mod:`~trainstream.torch._gradcopy`, ``grad_copies``),
  else against the staged host copy sent back up over PCIe (the gradient's bytes once more), no memory kept.

Where it does not hold the update is redone from the pre-step state (``trainstream.core._speculate``). The
multiplier assumed is GradScaler's inverse scale of the last step that showed it (``grad_scale``), or the power
of two ``param.grad`` was found to be scaled by after a ``GradScaler.unscale_`` (:func:`power_of_two_ratio`):
scales change rarely, so such steps commit too.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import torch

from .. import contract as C
from ..backends.torch import _DTYPE_NAME
from ..core import _budget
from . import _dist as D
from ._params import Slot

if TYPE_CHECKING:
    from ._grads import StagedCopy

__all__ = ["Assumed", "SpeculationPolicy", "bits_differ", "bits_hold", "copy_differs", "power_of_two_ratio", "read_all"]

#: The integer views of a gradient's bits, by element size.
_BITS = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
#: Elements of a GPU gradient compared at a time (their staged bits copied up: 64 MiB of bf16 scratch).
_PIECE = 1 << 25


class Assumed(NamedTuple):
    """What a speculative update assumed: its group's hyper-parameters, the multiplier of the staged gradient
    (the contract's ``c``: GradScaler's inverse scale for non-fused recipes) and GradScaler's scale a fused
    recipe's kernel divides by (None: none)."""

    hp: Any
    coef: float = 1.0
    grad_div: float | None = None


def bits_hold(grad: torch.Tensor, staged: np.ndarray, coef: float) -> bool:
    """Whether ``grad``'s bits are the staged gradient's (float32, or the uint16 bits of fp16/bf16) times ``coef``
    in float32, rounded to the gradient's dtype as torch's in-place multiplications of gradients (clipping,
    unscaling) round (``coef`` 1.0: the staged bits themselves). :func:`bits_differ`, read at once."""
    return not bool(bits_differ(grad, staged, coef))


def bits_differ(grad: torch.Tensor, staged: np.ndarray, coef: float) -> bool | torch.Tensor:
    """:func:`bits_hold`'s negation, not read yet where ``grad`` is on a GPU: a 0-dim bool tensor there (the caller
    reads every parameter's at once: one synchronisation per step). Compared where ``grad`` is: a GPU gradient
    against the pinned staging copied up in pieces of :data:`_PIECE` elements (no host copy of the gradient)."""
    g = D.local(grad).detach().reshape(-1)
    if g.dtype not in _DTYPE_NAME or g.numel() != staged.size or g.element_size() != staged.itemsize:
        return True
    ints, np_ints = _BITS[g.element_size()]
    if g.device.type == "cpu" and coef == 1.0:
        return not np.array_equal(g.view(ints).numpy(), staged.view(np_ints))
    host = torch.from_numpy(staged.view(np_ints))
    return _differ(g, lambda b, e: host[b:e].to(g.device, non_blocking=True).view(g.dtype), coef)


def copy_differs(grad: torch.Tensor, copy: torch.Tensor, coef: float) -> bool | torch.Tensor:
    """:func:`bits_differ` against ``copy``, a copy of the gradient kept on its device by the hook
    (:mod:`~trainstream.torch._gradcopy`) instead of the staged host one: the same arithmetic, no transfer."""
    g, c = D.local(grad).detach().reshape(-1), copy.reshape(-1)
    if g.dtype not in _DTYPE_NAME or g.dtype != c.dtype or g.numel() != c.numel() or g.device != c.device:
        return True
    return _differ(g, lambda b, e: c[b:e], coef)


def _differ(g: torch.Tensor, ref: Callable[[int, int], torch.Tensor], coef: float) -> bool | torch.Tensor:
    """Whether flat ``g``'s bits differ from ``ref(begin, end)`` (the reference's elements, ``g``'s dtype and
    device) times ``coef`` in float32, rounded to ``g``'s dtype, in pieces of :data:`_PIECE` elements: a 0-dim
    bool tensor on a GPU (not read), a bool on the CPU."""
    ints = _BITS[g.element_size()][0]
    bad = None
    for b in range(0, g.numel(), _PIECE):
        e = min(g.numel(), b + _PIECE)
        r = ref(b, e)
        if coef != 1.0:
            r = (r.float() * coef).to(g.dtype)
        piece = (g[b:e].view(ints) != r.view(ints)).any()
        bad = piece if bad is None else bad | piece
    if bad is None:
        return False
    return bad if g.device.type != "cpu" else bool(bad)


def read_all(verdicts: dict[int, bool | torch.Tensor]) -> dict[int, bool]:
    """``verdicts`` (:func:`bits_differ`'s, or plain bools) as bools, the GPU ones read with one copy per device."""
    out = {k: v for k, v in verdicts.items() if isinstance(v, bool)}
    by_device: dict[torch.device, list[int]] = {}
    for k, v in verdicts.items():
        if not isinstance(v, bool):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        out.update(zip(keys, torch.stack([verdicts[k] for k in keys]).tolist()))
    return out


def power_of_two_ratio(grad: torch.Tensor, staged: np.ndarray, dtype: str) -> float | None:
    """The power of two ``grad`` is the staged gradient times, read at the staged element of largest magnitude
    among the first 4096 (a guess for the next speculation, checked there), or None."""
    g = D.local(grad).detach().reshape(-1)
    n = min(4096, staged.size, g.numel())
    if not n or g.element_size() != staged.itemsize:
        return None
    now = g[:n].cpu().float().numpy().astype(np.float64)
    if dtype == "float32":
        was = staged[:n].view(np.float32).astype(np.float64)
    elif dtype == "float16":
        was = staged[:n].view(np.float16).astype(np.float64)
    else:
        was = C.bf16_bits_to_f32(staged[:n].view(np.uint16)).astype(np.float64)
    mags = np.where(np.isfinite(was), np.abs(was), 0.0)
    i = int(np.argmax(mags))
    if mags[i] == 0.0 or not np.isfinite(now[i]) or now[i] == 0.0:
        return None
    ratio = now[i] / was[i]
    return ratio if ratio > 0 and math.frexp(ratio)[0] == 0.5 else None


class SpeculationPolicy:
    """When :class:`~trainstream.torch._grads.GradCapture` speculates, what it assumes, and whether a speculative
    update holds at ``step()`` (its attributes: ``slots``, ``speculate``, ``copies``, ``_expect``, ``_signalled``,
    ``_scale``, ``_user_unscales``, ``_scaled``, ``_untrusted``, ``slot_hyper``)."""

    def _hyper_now(self, rec: Slot) -> C.AdamWHyperParams | None:
        """``rec``'s group's hyper-parameters now, or None where they cannot be had (a group edit that is refused, a
        parameter no longer in any group: ``step()`` checks the groups, raising before anything changes where it
        must): not speculated."""
        try:
            return self.slot_hyper(rec)
        except Exception:  # noqa: BLE001 - step() is where the groups are checked and refused
            return None

    def _assume(self, rec: Slot, hp: C.AdamWHyperParams) -> Assumed:
        """What ``rec``'s speculative update assumes of ``step()``: GradScaler's scale as last seen (a fused
        recipe's kernel divides by it; the others' gradient is multiplied by its float32 inverse), else nothing."""
        if self._scale is None:
            return Assumed(hp)
        if rec.recipe.impl == "fused" and not self._user_unscales:  # else unscale_ multiplied param.grad
            return Assumed(hp, 1.0, self._scale)
        return Assumed(hp, float(torch.tensor(self._scale, dtype=torch.float64).reciprocal().float()))

    def _speculates(self, rec: Slot, n: int, hint: bool) -> bool:
        """Whether this backward's update of host slot ``rec`` starts now: under ``last_micro_batch()`` (``hint``); where
        Accelerate's gradient state says this micro-batch syncs (HF Trainer and ``accelerator.accumulate`` set it; once
        it was seen saying it does not); else at the ``n``-th backward where the last step had ``n``. Not for fp32
        gradient sums or a slot whose staging the update overwrites (``Engine.can_speculate``), nor where
        ``speculate`` is False or (None) the host memory budget has no room for the kept copies."""
        if self.speculate is False or rec.sums or rec.broken or not self.slots.engine.can_speculate(rec.sid):
            return False
        if not hint and not self._last_by_signal(rec, n, exact=True):
            return False
        if self.speculate is None:
            self.speculate = self._budget_allows()
            self._in_place = self._in_place or not self.speculate  # no room for copies: in place where hinted
        return bool(self.speculate)

    def _last_by_signal(self, rec: Slot, n: int, exact: bool) -> bool:
        """Whether this backward (the ``n``-th before ``step()``) is taken as the last: Accelerate's gradient state
        says whether this micro-batch syncs (trusted once it was seen saying one does not, see
        :meth:`_signalled_last`); without its trusted word, the last step's count of backwards decides, ``n`` equal
        to it (``exact``) or not below it."""
        syncs = _accelerate_syncs()
        if syncs is False:
            self._signalled = True
            return False
        if syncs and self._signalled:
            return True
        expect = self._expect.get(rec.sid, 1)
        return n == expect if exact else n >= expect

    def _signalled_last(self) -> bool:
        """Whether Accelerate's gradient state says this backward is the last before ``step()`` and may be trusted
        (it was seen saying another one was not: HF Trainer and ``accelerator.accumulate`` with accumulation; alone
        it says so of every backward, also where a loop accumulates by hand): the weights are uploaded during
        backward, as under ``last_micro_batch()``."""
        return self._signalled and _accelerate_syncs() is True

    def _budget_allows(self) -> bool:
        """``speculate=None``'s decision, once: the kept copies of every host slot fit in the host memory available
        now less ``host_margin`` of it; else speculation stays off, with a warning naming the choice."""
        engine = self.slots.engine
        sids = [rec.sid for rec in self.slots if engine.can_speculate(rec.sid)]
        need = engine.speculation_bytes(sids)
        margin = self.slots.host_margin
        if _budget.speculation_fits(need, margin):
            return True
        warnings.warn(f"OffloadAdamW: updates during backward (speculation) need {need:,} more bytes of host memory "
                      f"(the pre-step copies of weights and state) than host_margin={margin} leaves; they wait for "
                      "step() instead (inside last_micro_batch() they run in place, and step() refuses a gradient "
                      "changed after that backward). speculate=True takes the memory anyway, speculate=False silences this.",
                      RuntimeWarning, stacklevel=5)
        return False

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

    def _verdicts(self, checks: list[tuple[Slot, StagedCopy | None, StagedCopy, Assumed, C.AdamWHyperParams]]
                  ) -> dict[int, bool]:
        """Per slot id of ``checks`` (``(rec, copy, ref, assumed, hp)``): whether its speculative update is bit for
        bit what torch's step computes now (:mod:`~trainstream.torch._validate`). Every comparison is launched
        first (with the gradient's device copy where its hook kept one, :mod:`~trainstream.torch._gradcopy`, else
        with its staged host copy) and all are read at once; the device copies are dropped then. GradScaler's
        power-of-two scaling is learnt where ``unscale_`` hid it."""
        engine, copies, verdicts, compared = self.slots.engine, self.copies, {}, {}
        for rec, copy, ref, assumed, hp in checks:
            p, sid = rec.param, rec.sid
            kept = copies.pop(sid)  # dropped with ``compared`` once read, else now
            if hp != assumed.hp or self._scaled.get(sid) != assumed.grad_div or not engine.speculative(sid):
                verdicts[sid] = False
            elif not self._untrusted and copy is not None and copy.grad() is ref.grad() and copy.current(
                    p, trusted=True):
                verdicts[sid] = (1.0 if copy.coef is None else copy.coef) == assumed.coef
            elif assumed.grad_div is not None:
                verdicts[sid] = False
            else:
                compared[sid] = (rec, kept)
                if kept is not None:
                    verdicts[sid] = copy_differs(p.grad, kept, assumed.coef)
                else:
                    verdicts[sid] = bits_differ(p.grad, engine.staged_grad(sid), assumed.coef)
                copies.checked["staged" if kept is None else "device"] += 1
        differ = read_all({sid: verdicts[sid] for sid in compared})
        for sid, (rec, _) in compared.items():
            verdicts[sid] = not differ[sid]
            if differ[sid] and self._untrusted and (ratio := power_of_two_ratio(
                    rec.param.grad, engine.staged_grad(sid), rec.recipe.dtype)) is not None:
                self._scale = 1.0 / ratio  # GradScaler.unscale_'s, guessed for the next step (checked there)
        if checks:
            copies.want = bool(compared)  # the next step keeps copies where this one compared bits
        return verdicts

    def _copies_need(self, device: torch.device) -> tuple[int, int]:
        """The bytes of device copies of every speculable gradient on ``device``, and of those gradients not
        allocated yet (``grad_copies=None``'s decision, :mod:`~trainstream.torch._gradcopy`)."""
        engine, copies, pending = self.slots.engine, 0, 0
        for rec in self.slots:
            loc = D.local(rec.param)
            if loc.device == device and rec.param.requires_grad and engine.can_speculate(rec.sid):
                nbytes = loc.numel() * loc.element_size()
                copies += nbytes
                pending += nbytes if rec.param.grad is None else 0
        return copies, pending


def _accelerate_syncs() -> bool | None:
    """Accelerate's ``GradientState.sync_gradients`` where Accelerate is imported and it is set (whether this
    micro-batch is the last before the optimizer step), else None. Read, never imported or changed."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    value = shared.get("sync_gradients") if isinstance(shared, dict) else None
    return value if isinstance(value, bool) else None
