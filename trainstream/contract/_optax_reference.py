"""The optax/cpu lines of :mod:`trainstream.contract` in NumPy float32 (:func:`optax_reference_update`), every family
of leaf dtype and state, and XLA:CPU's float32 ``rsqrt`` (:func:`xla_rsqrt`). The tests hold the host kernels and
jitted optax to them. Import these names from :mod:`trainstream.contract`."""

from __future__ import annotations

import numpy as np

from ._reference import bf16_bits_to_f32, f32_to_bf16_bits, fma_f32, ftz
from ._scalars import (OX_B1_HALF, OX_B2_HALF, OX_CLIP, OX_FORM_R, OX_HALF, OX_HALF_DIV, OX_MU_BF16, OX_MU_F32,
                       OX_MU_SWAP, OX_NESTEROV, OX_NO_FMA, OX_NUM_SWAP, OX_NU_SWAP, OX_RSQRT, OX_RSQRT_DIV, S_BC1,
                       S_BC1_NEXT, S_BC2_OPTAX, S_BETA1, S_BETA1_MU, S_BETA2, S_CLIP, S_CLIP_DIV, S_EPS, S_EPS_ROOT,
                       S_NEG_LR, S_OMB1, S_OMB2, S_OX_CODE, S_WD, optax_code_valid, optax_rsqrt_decay_last)

_F32 = np.float32
_TINY = _F32(2.0**-126)


def round_xla(x, dtype: str) -> np.ndarray:
    """float32 -> ``dtype`` -> float32 as XLA:CPU converts (RNE; a NaN keeps its sign, and in float16 the top of its
    payload, quieted: ``sign | 0x7E00 | mantissa >> 13``; bfloat16: ``sign | 0x7FC0``)."""
    x = np.asarray(x, _F32)
    if dtype == "float32":
        return x
    u = x.view(np.uint32)
    sign = (u >> 16) & np.uint32(0x8000)
    if dtype == "bfloat16":
        bits = np.where(np.isnan(x), sign | np.uint32(0x7FC0), f32_to_bf16_bits(x)).astype(np.uint16)
        return bf16_bits_to_f32(bits)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16).view(np.uint16)
    nan = sign | np.uint32(0x7E00) | ((u >> 13) & np.uint32(0x3FF))
    return np.where(np.isnan(x), nan, h).astype(np.uint16).view(np.float16).astype(_F32)


def _fma(code: int):
    """The lines' ``fma(a, b, c)``: one rounding, or (``OX_NO_FMA``) ``RN(RN(a*b) + c)`` with the product flushed."""
    if code & OX_NO_FMA:
        return lambda a, b, c: ftz(ftz(a * b) + c)
    return lambda a, b, c: ftz(fma_f32(a, b, c))


def xla_rsqrt(x, code: int, estimate=None) -> np.ndarray:
    """XLA:CPU's float32 ``rsqrt`` of (flushed) ``x``: ``RN(1 / RN(sqrt(x)))`` with :data:`OX_RSQRT_DIV`, else the
    CPU's estimate ``y0 = estimate(x)`` (``rsqrtss``: its table is the vendor's; the host kernels' is
    ``trainstream._host_kernels.rsqrt_estimate``) and one Newton step, ``fma(RN(-0.5*y0), fma(y0, RN(y0*x), -1),
    y0)`` (unfused with :data:`OX_NO_FMA`), ``y0`` itself for ``x < 2**-126`` and ``+inf``."""
    x = ftz(x)
    with np.errstate(all="ignore"):
        if code & OX_RSQRT_DIV:
            return ftz(_F32(1) / ftz(np.sqrt(x)))
        if estimate is None:
            raise ValueError("xla_rsqrt: the estimate form needs the CPU's estimate (estimate=)")
        fma = _fma(code)
        y0 = np.asarray(estimate(x), _F32)
        e = fma(y0, ftz(y0 * x), _F32(-1))
        y1 = fma(ftz(_F32(-0.5) * y0), e, y0)
    return np.where((x < _TINY) | (x == np.inf), y0, y1).astype(_F32)


def optax_reference_update(p, m, v, g, scalars, dtype: str = "float32", rsqrt_estimate=None):
    """One optax/cpu update of one leaf (the contract's lines): ``(p, m, v, u)`` as float32 arrays holding values of
    their dtypes (``u``: the update before the learning rate, in the update's dtype). ``p``, ``m``, ``v``, ``g``:
    float32 arrays holding the values of the leaf's (``dtype``), mu's and nu's dtypes (:func:`optax_family`);
    ``scalars``: the leaf's row of :func:`optax_scalar_matrix` (its code at ``S_OX_CODE``); ``rsqrt_estimate``: the
    CPU's estimate for :data:`OX_RSQRT` without :data:`OX_RSQRT_DIV` (:func:`xla_rsqrt`)."""
    s = np.asarray(scalars, _F32)
    code = int(s[S_OX_CODE])
    if float(code) != float(s[S_OX_CODE]) or not optax_code_valid(code):
        raise ValueError(f"scalars[S_OX_CODE] = {s[S_OX_CODE]!r} is not an optax/cpu code")
    p, m, v, g = (ftz(np.asarray(a, _F32)) for a in (p, m, v, g))
    with np.errstate(all="ignore"):
        if not code & OX_HALF:
            return _float32_lines(p, m, v, g, s, code, rsqrt_estimate)
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"OX_HALF needs a float16 or bfloat16 leaf, got {dtype}")
        if code & OX_MU_F32:
            return _mixed_lines(p, m, v, g, s, code, dtype)
        return _half_lines(p, m, v, g, s, code, dtype)


def _float32_lines(p, m, v, g, s, code, rsqrt_estimate):
    """float32 state (the fp32 master's too); :data:`OX_MU_BF16`: mu stored in bfloat16."""
    z, fma = ftz, _fma(code)
    B1, C1, B2, C2, B1mu = (z(s[k]) for k in (S_BETA1, S_OMB1, S_BETA2, S_OMB2, S_BETA1_MU))
    d1, d2, d1n, eps, er = (z(s[k]) for k in (S_BC1, S_BC2_OPTAX, S_BC1_NEXT, S_EPS, S_EPS_ROOT))
    wd, neg_lr, mul, div = (z(s[k]) for k in (S_WD, S_NEG_LR, S_CLIP, S_CLIP_DIV))
    mb = B1mu if code & OX_MU_BF16 else B1
    g = z(z(g / div) * mul) if code & OX_CLIP else z(g * mul)
    if code & OX_B1_HALF and not code & OX_MU_BF16:  # (g + m) * b1 (mu_dtype=bfloat16: nesterov's numerator only)
        m = z(z(g + m) * B1)
    else:
        m = fma(mb, m, z(C1 * g)) if code & OX_MU_SWAP else fma(C1, g, z(mb * m))
    if code & OX_B2_HALF:  # (g*g + v) * b2, g*g + v contracted
        v = z(fma(g, g, v) * B2)
    else:
        gg = z(g * g)
        v = fma(B2, v, z(C2 * gg)) if code & OX_NU_SWAP else fma(C2, gg, z(B2 * v))
    form_r = code & OX_FORM_R
    r1, r2 = z(_F32(1) / d1), z(_F32(1) / d2)
    vh = fma(v, r2, er) if form_r else z(z(v / d2) + er)  # form R: LLVM contracts v*r2 + eps_root
    if code & OX_NESTEROV:
        mn = z(m * z(_F32(1) / d1n)) if form_r else z(m / d1n)
        gn = z(g * r1) if form_r else z(g / d1)
        if code & OX_B1_HALF:  # XLA: (mn + gn) * b1; in form R LLVM contracts g*r1 into the sum
            num = z((fma(g, r1, mn) if form_r else z(mn + gn)) * B1)
        else:
            num = fma(C1, gn, z(B1 * mn)) if code & OX_NUM_SWAP else fma(B1, mn, z(C1 * gn))
        u = z(num / z(z(np.sqrt(vh)) + eps))
    elif code & OX_RSQRT:  # m / sqrt(v) -> m * rsqrt(v); with decay one of m*rs and wd*p is fused (by the family)
        mh = z(m * r1) if form_r else z(m / d1)
        rs = xla_rsqrt(vh, code, rsqrt_estimate)
        if wd != 0 and not optax_rsqrt_decay_last(code):
            u = fma(mh, rs, z(wd * p))
            wd = _F32(0)
        else:
            u = z(mh * rs)
    elif form_r:
        u = z(z(m * r1) / z(z(np.sqrt(vh)) + eps))
    else:
        u = z(m / z(d1 * z(z(np.sqrt(vh)) + eps)))
    if wd != 0:
        u = fma(wd, p, u)
    p = fma(neg_lr, u, p)
    return p, round_xla(m, "bfloat16") if code & OX_MU_BF16 else m, v, u


def _half_lines(p, m, v, g, s, code, dtype):
    """fp16/bf16 params, mu and nu: every operation in float32 (flushed) and rounded to the dtype."""
    z = ftz
    R = lambda x: round_xla(z(x), dtype)  # noqa: E731
    B1, C1, B2, C2, eps, er, wd, neg_lr = (z(s[k]) for k in (S_BETA1, S_OMB1, S_BETA2, S_OMB2, S_EPS, S_EPS_ROOT,
                                                              S_WD, S_NEG_LR))
    # the corrections in the dtype; their reciprocals in float32 (bf16) or in half (fp16)
    recip = (lambda d: z(_F32(1) / z(d))) if dtype == "bfloat16" else (lambda d: R(_F32(1) / d))  # noqa: E731
    r1, r2, r1n = (recip(s[k]) for k in (S_BC1, S_BC2_OPTAX, S_BC1_NEXT))
    d1, d2, d1n = (z(s[k]) for k in (S_BC1, S_BC2_OPTAX, S_BC1_NEXT))
    div = code & OX_HALF_DIV  # a one-element leaf: x / d (in float32 for bf16, in half for fp16), not x * (1/d)
    sc = lambda x, d, r: R(x / d) if div else R(x * r)  # noqa: E731
    m_old, v_old = m, v
    m = R(R(g + m) * B1) if code & OX_B1_HALF else R(R(C1 * g) + R(B1 * m))
    gg = R(g * g)
    v = R(R(gg + v) * B2) if code & OX_B2_HALF else R(R(C2 * gg) + R(B2 * v))
    if code & OX_B2_HALF and dtype == "float16":  # the update's loop recomputes v: (gg + v_old) * RH(r2*b2)
        vh = R(R(R(gg + v_old) * R(r2 * B2)) + er)
    else:
        vh = R(sc(v, d2, r2) + er)
    if code & OX_NESTEROV:
        num = R(R(B1 * sc(m, d1n, r1n)) + R(C1 * sc(g, d1, r1)))
    elif code & OX_B1_HALF and dtype == "float16":  # the update's loop recomputes m: (g + m_old) * RH(r1*b1)
        num = R(R(g + m_old) * R(r1 * B1))
    else:
        num = sc(m, d1, r1)
    if code & OX_RSQRT:  # float16 with eps == 0 in the dtype: XLA's half rsqrt, RH(1/RN(sqrt)) (checked per process)
        u = R(num * R(_F32(1) / z(np.sqrt(vh))))
    elif div and dtype == "float16" and not code & (OX_NESTEROV | OX_B1_HALF):  # XLA: (m / d1) / den -> m / (d1*den)
        u = R(m / R(d1 * R(R(np.sqrt(vh)) + eps)))
    else:
        u = R(num / R(R(np.sqrt(vh)) + eps))
    if wd != 0:
        u = R(u + R(wd * p))
    return R(p + R(u * neg_lr)), m, v, u


def _mixed_lines(p, m, v, g, s, code, dtype):
    """fp16/bf16 params and nu, mu float32 (``mu_dtype=float32``)."""
    z, fma = ftz, _fma(code)
    R = lambda x: round_xla(z(x), dtype)  # noqa: E731
    B1, C1, B2, C2, eps, er, wd, neg_lr = (z(s[k]) for k in (S_BETA1, S_OMB1, S_BETA2, S_OMB2, S_EPS, S_EPS_ROOT,
                                                              S_WD, S_NEG_LR))
    d1, d1n, d2 = z(s[S_BC1]), z(s[S_BC1_NEXT]), z(s[S_BC2_OPTAX])
    bf16 = dtype == "bfloat16"
    if bf16:  # the product of the bf16 constant stays unrounded in float32; B1*m is the one fused
        m = fma(C1, g, z(B1 * m)) if code & OX_MU_SWAP else fma(B1, m, z(C1 * g))
        r2 = z(_F32(1) / d2)
    else:
        m = fma(B1, m, R(C1 * g))
        r2 = R(_F32(1) / d2)
    gg = R(g * g)
    v_old = v
    v = R(R(gg + v) * B2) if code & OX_B2_HALF else R(R(C2 * gg) + R(B2 * v))
    if code & OX_B2_HALF and not bf16:  # the update's loop recomputes v, as fp16 state's: (gg + v_old) * RH(r2*b2)
        vh = R(R(R(gg + v_old) * R(r2 * B2)) + er)
    else:
        vh = R(R(v / R(d2)) + er) if code & OX_HALF_DIV else R(R(v * r2) + er)
    den = z(R(np.sqrt(vh)) + eps) if bf16 else R(R(np.sqrt(vh)) + eps)
    form_r = code & OX_FORM_R  # mu's divisions by d1 and d1n (float32) as multiplies by their float32 reciprocals
    if code & OX_NESTEROV:
        r1 = z(_F32(1) / R(d1)) if bf16 else R(_F32(1) / R(d1))
        gn = R(g / R(d1)) if code & OX_HALF_DIV else R(g * r1)
        mn = z(m * z(_F32(1) / d1n)) if form_r else z(m / d1n)
        num = fma(B1, mn, z(C1 * gn)) if bf16 else fma(B1, mn, R(C1 * gn))
        u = z(num / den)
    elif form_r:
        u = z(z(m * z(_F32(1) / d1)) / den)
    else:
        u = z(m / z(d1 * den))
    if wd != 0:
        u = fma(wd, p, u) if bf16 else z(u + R(wd * p))
    return R(fma(neg_lr, u, p)), m, v, u
