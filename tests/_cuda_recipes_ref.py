"""A NumPy emulation of torch's CUDA recipes as ``kernels/adamw_torch.cu`` computes them, line for line, from the same
scalar vector and flags (:mod:`trainstream._device_recipes`): the tests' stand-in for the kernels on CPU (the staging
ring's simulation) and, beside torch on the GPU, their diagnosis (which line a mismatch comes from). Arrays are
float32 holding values of their dtype; the fused bias corrections use ``powf`` (NumPy's float32 power, the host's
powf, by default; pass the device's). Not the contract's reference (trainstream.contract owns that)."""

from __future__ import annotations

import numpy as np

from trainstream import _device_recipes as R
from trainstream import contract as C

S = R.SCALAR_INDEX
f32 = np.float32


def rnd(x, dtype: str) -> np.ndarray:
    """x rounded to ``dtype`` (torch's CUDA conversion; float32: as is)."""
    x = np.asarray(x, np.float32)
    return x if dtype == "float32" else C.round_to(x, dtype)


def host_powf(b, t) -> np.float32:
    with np.errstate(all="ignore"):
        return f32(np.power(f32(b), f32(t)))


def fused_bias_corrections(s, powf=host_powf):
    """(1 - b1^t, sqrt(1 - b2^t), lr / (1 - b1^t)) in float32, as TsFused::prepare."""
    t = s[S["S_STEP"]]
    bc1 = f32(f32(1) - powf(s[S["S_BETA1"]], t))
    bc2s = f32(np.sqrt(f32(f32(1) - powf(s[S["S_BETA2"]], t))))
    with np.errstate(all="ignore"):
        return bc1, bc2s, f32(f32(-s[S["S_NEG_LR"]]) / bc1)


def recipe_step(recipe, p, g, m, v, vmax, s, flags, *, grad_dtype=None, base=0, bias=None):
    """One update of ``recipe`` (TorchRecipe) of elements ``base .. base+n`` of a tensor: ``p`` the weights (or
    fp32 master), ``g`` the gradient as stored, ``m``, ``v``, ``vmax`` (None without amsgrad) the state values;
    ``s`` the scalar vector, ``flags`` the TS_F_* flags. ``bias``: fused's (bc1, bc2s, ss), default from the host's
    powf. Returns ``(p, m, v, vmax, g_written_back)``; p, m, v, vmax rounded as the kernel stores them."""
    fma = C.fma_f32
    sd = R.state_dtype(recipe)
    gd = grad_dtype or recipe.dtype
    p, g, m, v = (np.asarray(a, np.float32).copy() for a in (p, g, m, v))
    x = None if vmax is None else np.asarray(vmax, np.float32).copy()
    with np.errstate(all="ignore"):
        if recipe.impl == "fused":
            bc1, bc2s, ss = bias if bias is not None else fused_bias_corrections(s)
            g_back = g
            if flags & R.F_GRAD_SCALE:
                g = (g / s[S["S_GRAD_DIV"]]).astype(np.float32)
                g_back = g
            g = (g * s[S["S_CLIP"]]).astype(np.float32)
            if not flags & R.F_GRAD_SCALE:
                g = rnd(g, gd)
            if flags & R.F_L2:
                wd = s[S["S_L2"]]
                idx = base + np.arange(p.size)
                ii = (idx & 3) if flags & R.F_TORCH_VEC else ((idx >> 9) & 3)
                split = x is None and not flags & R.F_GRAD_SCALE  # see kernels/adamw_torch.cu
                unfused = split & (bool(flags & R.F_MAXIMIZE) | (ii == 0))
                g = np.where(unfused, (g + (p * wd).astype(np.float32)).astype(np.float32), fma(p, wd, g))
            if flags & R.F_DECAY:
                p = fma(s[S["S_NEG_LR_WD"]], p, p)
            b1, b2 = s[S["S_BETA1"]], s[S["S_BETA2"]]
            m = fma(b1, m, fma(-b1, g, g))
            gg = (g * g).astype(np.float32)
            v = fma(b2, v, fma(-b2, gg, gg))
            src = v
            if x is not None:
                x = np.where(x < v, v, x).astype(np.float32)
                src = x
            d = ((np.sqrt(src) / bc2s).astype(np.float32) + s[S["S_EPS"]]).astype(np.float32)
            p = (p - ((ss * m).astype(np.float32) / d).astype(np.float32)).astype(np.float32)
            return rnd(p, sd), rnd(m, sd), rnd(v, sd), None if x is None else rnd(x, sd), rnd(g_back, gd)
        r = (lambda a: rnd(a, sd))  # op by op: every result rounded to the state dtype
        g = rnd(g * s[S["S_CLIP"]], gd)
        if flags & R.F_L2:
            g = r(fma(s[S["S_L2"]], p, g))
        p1 = r(p * s[S["S_DECAY"]]) if flags & R.F_DECAY else p
        diff = (g - m).astype(np.float32)
        w = s[S["S_OMB1"]]
        m = r(fma(w, diff, m) if s[S["S_LERP_SMALL"]] != 0 else fma(f32(w - f32(1)), diff, g))
        v = r(fma(s[S["S_OMB2"]], (g * g).astype(np.float32), r(v * s[S["S_BETA2"]])))
        src = v
        if x is not None:
            x = np.where(np.isnan(x) | (x > v), x, v).astype(np.float32)
            src = x
        q = r(np.sqrt(src))
        d1 = r(q * s[S["S_INV_SQRT_BC2"]]) if flags & R.F_SINGLE else r(q / s[S["S_SQRT_BC2"]])
        d = r(d1 + s[S["S_EPS"]])
        p = r(fma(s[S["S_NEG_STEP"]], (m / d).astype(np.float32), p1))
        return p, m, v, x, g
