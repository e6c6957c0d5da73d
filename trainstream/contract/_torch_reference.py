"""The executable form of the torch recipes' lines (package docstring, "torch"): :func:`torch_reference_update`, in
NumPy float32 with the exact helpers of :mod:`._reference`. The tests hold every host kernel and the real
``torch.optim.AdamW``/``Adam`` to it. Import these names from :mod:`trainstream.contract`."""

from __future__ import annotations

import numpy as np

from ._reference import fma_f32, round_to
from ._scalars import (S_BETA1, S_BETA2, S_CLIP, S_DECAY, S_EPS, S_GRAD_DIV, S_INV_SQRT_BC2, S_L2, S_LERP_SMALL,
                       S_NEG_LR_WD, S_NEG_STEP, S_OMB1, S_OMB2, S_SQRT_BC2)
from ._torch import TorchRecipe, check_recipe, math_dtype, torch_family

_F32 = np.float32


def _unfused(a, b, c):
    """``RN(RN(a*b) + c)``: ATen's DEFAULT level, where the vector kernels' FMAs are two roundings."""
    return np.asarray(np.asarray(a, _F32) * np.asarray(b, _F32), _F32) + np.asarray(c, _F32)


def _max_nan(a, b):
    """``torch.maximum``/``Vectorized::maximum``: NaN in either gives NaN."""
    return np.where(np.isnan(a) | np.isnan(b), a + b, np.maximum(a, b)).astype(_F32)


def _std_max(a, b):
    """``std::max(a, b)`` = ``(a < b) ? b : a`` (NaN in ``b``: ``a``)."""
    return np.where(a < b, b, a).astype(_F32)


def torch_reference_update(recipe: TorchRecipe, state: dict, g, scalars, *, grad_dtype: str | None = None,
                           sqrt=np.sqrt, fma: bool = True, tail=None) -> dict:
    """One update of ``recipe`` in NumPy float32 (the package docstring's lines); returns a new state dict.

    ``state``: ``p`` (float32: the master, or the weights' values), ``m``, ``v`` and with ``amsgrad`` ``vmax`` (float32
    arrays holding values of the state dtype). ``g``: the gradient's float32 values (its dtype's, or an fp32 sum),
    rounded after ``g * c`` to ``grad_dtype`` (default: the parameter's dtype). ``scalars``:
    :func:`~trainstream.contract.torch_scalars`. ``sqrt``: ``msqrt``, torch/cpu's root of float32 state for CPU
    single/foreach (default IEEE); ``fma=False``: ATen's DEFAULT level (:data:`TC_NO_FMA`; CPU only); ``tail``: a
    boolean mask of the elements in torch's scalar tail loop (:func:`~trainstream.contract.torch_cpu_tails`).
    Returns ``p``, ``m``, ``v`` (``vmax``) as float32 arrays of the state dtype's values, and ``weights``, ``r(p)`` in
    the parameter's dtype."""
    recipe = check_recipe(recipe)
    fam, k = torch_family(recipe), math_dtype(recipe)
    s = np.asarray(scalars, _F32)
    p, m, v = (np.asarray(state[key], _F32).reshape(-1) for key in ("p", "m", "v"))
    n = p.size
    tail = np.zeros(n, bool) if tail is None else np.asarray(tail, bool).reshape(-1)
    if fam == "cpu_default" or fam == "cpu_fused":
        mad = fma_f32 if fma else _unfused
        per_op = fam == "cpu_default"
    else:
        mad, per_op = fma_f32, fam != "cuda_fused"

    def r(x):  # the rounding of one tensor op's result (identity for float32 math and the fused kernels)
        return round_to(x, k) if per_op else np.asarray(x, _F32)

    with np.errstate(all="ignore"):
        g = round_to(np.asarray(g, _F32).reshape(-1) * s[S_CLIP], grad_dtype or recipe.dtype)
        if fam in ("cpu_fused", "cuda_fused") and s[S_GRAD_DIV] != 0:
            g = (g / s[S_GRAD_DIV]).astype(_F32)
        l2, vmax = s[S_L2], state.get("vmax")
        if fam == "cuda_fused":
            B1, B2 = s[S_BETA1], s[S_BETA2]
            if l2 != 0 and not recipe.amsgrad and s[S_GRAD_DIV] == 1 and s[S_CLIP] < 0:  # maximize: two roundings
                g = (g + (p * l2).astype(_F32)).astype(_F32)
            elif l2 != 0:  # (without maximize, some positions round twice: not reproduced, package docstring)
                g = fma_f32(p, l2, g)
            p1 = fma_f32(s[S_NEG_LR_WD], p, p) if s[S_NEG_LR_WD] != 0 else p
            m = fma_f32(B1, m, fma_f32(-B1, g, g))
            gg = (g * g).astype(_F32)
            v = fma_f32(B2, v, fma_f32(-B2, gg, gg))
        else:
            if l2 != 0:
                if fam == "cpu_default" and k != "float32":  # vector fmadd; tail (DEFAULT: everywhere) two roundings
                    two = r(g + r(l2 * p))
                    g = np.where(tail | (not fma), two, r(mad(p, l2, g))).astype(_F32)
                elif fam.startswith("cuda"):
                    g = r(fma_f32(l2, p, g))
                else:
                    g = mad(p, l2, g)
            p1 = r(p * s[S_DECAY])
            w = s[S_OMB1]
            d = (g - m).astype(_F32)
            m = r(mad(w, d, m) if s[S_LERP_SMALL] else mad(w - _F32(1), d, g))
            if fam == "cpu_fused":
                vec = mad((s[S_OMB2] * g).astype(_F32), g, (v * s[S_BETA2]).astype(_F32))
                scalar = mad(v, s[S_BETA2], ((s[S_OMB2] * g).astype(_F32) * g).astype(_F32))
                v = np.where(tail, scalar, vec).astype(_F32)
            elif fam == "cpu_default":
                v = r(mad((s[S_OMB2] * g).astype(_F32), g, r(v * s[S_BETA2])))
            else:
                v = r(fma_f32(s[S_OMB2], (g * g).astype(_F32), r(v * s[S_BETA2])))
        if recipe.amsgrad:
            vmax = np.asarray(vmax, _F32).reshape(-1)
            if fam == "cuda_fused":
                vmax = _std_max(vmax, v)
            elif fam == "cpu_fused":
                vmax = np.where(tail, _std_max(vmax, v), _max_nan(vmax, v)).astype(_F32)
            else:
                vmax = _max_nan(vmax, v)
        src = vmax if recipe.amsgrad else v
        if fam == "cpu_default" and k == "float32":
            den = (np.asarray(sqrt(src), _F32) / s[S_SQRT_BC2]).astype(_F32) + s[S_EPS]
        elif fam in ("cpu_fused", "cuda_fused"):
            den = (np.sqrt(src) / s[S_SQRT_BC2]).astype(_F32) + s[S_EPS]
        else:
            q = r(np.sqrt(src))
            q = q * s[S_INV_SQRT_BC2] if fam == "cuda_single" else q / s[S_SQRT_BC2]
            den = r(r(q) + s[S_EPS])
        den = den.astype(_F32)
        if fam.startswith("cuda") and fam != "cuda_fused":
            p = r(fma_f32(s[S_NEG_STEP], (m / den).astype(_F32), p1))
        else:
            p = r(p1 + ((s[S_NEG_STEP] * m).astype(_F32) / den).astype(_F32))
    out = {"p": p.astype(_F32), "m": round_to(m, k), "v": round_to(v, k)}
    if recipe.amsgrad:
        out["vmax"] = round_to(vmax, k)
    out["weights"] = round_to(p, recipe.dtype)
    if k != "float32":  # no master: the weights are the rounded values
        out["p"] = out["weights"]
    return out
