"""Validation of speculative updates for :class:`~trainstream.torch._grads.GradCapture`: at ``step()``, whether
the update a gradient hook started (from the gradient it staged, times the multiplier it assumed, divided by the
GradScaler scale it assumed, with the hyper-parameters of its group then) is bit for bit the update
torch.optim.AdamW computes now. Detected, not assumed:

* ``param.grad`` is the tensor staged, at the same ``_version``: the multiplier torch's clipping or GradScaler's
  unscaling applied through this optimizer (``StagedCopy.coef``, else 1.0) and the scale its fused kernels
  divide by must be the ones assumed;
* else (the version moved: the loop's own ``clip_grad_norm_``, which multiplies even by 1.0, an edit by hand; or
  GradScaler's ``unscale_``, which moves no version): ``param.grad``'s bits must equal the staged gradient times
  the assumed multiplier, rounded as torch rounds it (the staged bits themselves for 1.0), compared on the
  gradient's device: the staged copy goes back up over PCIe (the gradient's bytes once more), no memory kept.

Where it does not hold the update is redone from the pre-step state (``trainstream.core._speculate``). The
multiplier assumed is GradScaler's inverse scale of the last step that showed it (``grad_scale``), or the power
of two ``param.grad`` was found to be scaled by after a ``GradScaler.unscale_`` (:func:`power_of_two_ratio`):
scales change rarely, so such steps commit too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import contract as C
from ..backends.torch import _DTYPE_NAME
from . import _dist as D

__all__ = ["Assumed", "bits_hold", "power_of_two_ratio"]

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
    unscaling) round (``coef`` 1.0: the staged bits themselves). Compared where ``grad`` is: a GPU gradient against
    the pinned staging copied up in pieces of :data:`_PIECE` elements (no host copy of the gradient)."""
    g = D.local(grad).detach().reshape(-1)
    if g.dtype not in _DTYPE_NAME or g.numel() != staged.size or g.element_size() != staged.itemsize:
        return False
    ints, np_ints = _BITS[g.element_size()]
    if g.device.type == "cpu" and coef == 1.0:
        return bool(np.array_equal(g.view(ints).numpy(), staged.view(np_ints)))
    host = torch.from_numpy(staged.view(np_ints))
    bad = torch.zeros((), dtype=torch.bool, device=g.device)
    for b in range(0, g.numel(), _PIECE):
        e = min(g.numel(), b + _PIECE)
        ref = host[b:e].to(g.device, non_blocking=True).view(g.dtype)
        if coef != 1.0:
            ref = (ref.float() * coef).to(g.dtype)
        bad |= (g[b:e].view(ints) != ref.view(ints)).any()
    return not bool(bad)


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
