"""Validation of speculative updates for :class:`~trainstream.torch._grads.GradCapture`: at ``step()``, whether
the update a gradient hook started (from the gradient it staged, times the multiplier it assumed, divided by the
GradScaler scale it assumed, with the hyper-parameters of its group then) is bit for bit the update
torch.optim.AdamW computes now. Detected, not assumed:

* ``param.grad`` is the tensor staged, at the same ``_version``: the multiplier torch's clipping or GradScaler's
  unscaling applied through this optimizer (``StagedCopy.coef``, else 1.0) and the scale its fused kernels
  divide by must be the ones assumed;
* else (the version moved: the loop's own ``clip_grad_norm_``, which multiplies even by 1.0, an edit by hand; or
  GradScaler's ``unscale_``, which moves no version): ``param.grad``'s bits, copied to the host, must equal the
  staged gradient times the assumed multiplier, rounded as torch rounds it (the staged bits themselves for 1.0).

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

__all__ = ["Assumed", "bits_hold", "host_bits", "power_of_two_ratio", "times"]

#: The unsigned views of a gradient's bits, by element size.
_BITS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


class Assumed(NamedTuple):
    """What a speculative update assumed: its group's hyper-parameters, the multiplier of the staged gradient
    (the contract's ``c``: GradScaler's inverse scale for non-fused recipes) and GradScaler's scale a fused
    recipe's kernel divides by (None: none)."""

    hp: Any
    coef: float = 1.0
    grad_div: float | None = None


def host_bits(grad: torch.Tensor) -> np.ndarray | None:
    """``grad``'s bits on the host (a GPU gradient is copied), as unsigned integers; None for other dtypes."""
    grad = D.local(grad).detach()
    if grad.dtype not in _DTYPE_NAME or grad.element_size() not in _BITS:
        return None
    ti, ni = _BITS[grad.element_size()]
    return grad.reshape(-1).view(ti).cpu().numpy().view(ni)


def times(staged: np.ndarray, coef: float, dtype: str) -> np.ndarray:
    """The bits of ``staged`` (float32, or the uint16 bits of fp16/bf16 ``dtype``) times ``coef`` in float32,
    rounded to ``dtype`` (nearest even), as torch's in-place multiplication of a gradient by a float32 scalar (its
    clipping and unscaling) computes it; unsigned integer bits."""
    c = np.float32(coef)
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "float32":
            return (staged.view(np.float32) * c).view(np.uint32)
        if dtype == "float16":
            return (staged.view(np.float16).astype(np.float32) * c).astype(np.float16).view(np.uint16)
        return C.f32_to_bf16_bits(C.bf16_bits_to_f32(staged.view(np.uint16)) * c).view(np.uint16)


def bits_hold(now: np.ndarray | None, staged: np.ndarray, coef: float, dtype: str) -> bool:
    """Whether gradient bits ``now`` are the staged bits times ``coef`` (:func:`times`; ``coef`` 1.0: themselves)."""
    if now is None or now.size != staged.size or now.itemsize != staged.itemsize:
        return False
    want = staged.view(now.dtype) if coef == 1.0 else times(staged, coef, dtype)
    return bool(np.array_equal(now, want))


def power_of_two_ratio(now: np.ndarray | None, staged: np.ndarray, dtype: str) -> float | None:
    """The power of two ``now`` is ``staged`` times at the staged element of largest magnitude among the first
    4096 (a guess for the next speculation, checked there), or None."""
    if now is None or now.size != staged.size or not staged.size:
        return None
    head = slice(0, min(4096, staged.size))
    if dtype == "float32":
        a, b = staged[head].view(np.float32).astype(np.float64), now[head].view(np.float32).astype(np.float64)
    elif dtype == "float16":
        a, b = staged[head].view(np.float16).astype(np.float64), now[head].view(np.float16).astype(np.float64)
    else:
        a = C.bf16_bits_to_f32(staged[head].view(np.uint16)).astype(np.float64)
        b = C.bf16_bits_to_f32(now[head].view(np.uint16)).astype(np.float64)
    with np.errstate(invalid="ignore"):
        mags = np.where(np.isfinite(a), np.abs(a), 0.0)
    i = int(np.argmax(mags))
    if mags[i] == 0.0 or not np.isfinite(b[i]) or b[i] == 0.0:
        return None
    ratio = b[i] / a[i]
    return ratio if ratio > 0 and math.frexp(ratio)[0] == 0.5 else None
