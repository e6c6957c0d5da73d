"""The optax kernel: the ``optax`` convention's update (:mod:`trainstream.contract`, cpu and cuda platforms) over
``[begin, end)`` of flat buffers, one compiled specialisation per key ``(variant, gkind, okind, code)``
(:func:`build_adamw`; the dispatch is the package's). ``okind``: 0 no weights out, 1/2 the new weights rounded to
fp16/bf16 into ``out16``, :data:`OUT_IN_GRAD` into the gradient buffer itself, :data:`OUT_U` the update ``u`` into
``out`` (``p`` read only), float32 or (fp16/bf16 state, :data:`~trainstream.contract.OX_HALF`) the leaf's bits.

optax/cpu codes of every family (:func:`trainstream.contract.optax_family`): float32 state (and ``OX_MU_BF16``: mu
stored as bfloat16 bits); ``OX_HALF``: the weights (``p``), mu and nu as the uint16 bits of the leaf's dtype
(``gkind``), every operation rounded to it; ``OX_HALF | OX_MU_F32``: mu float32. The lines are
:mod:`trainstream.contract._optax_reference`'s, one for one. optax/cuda codes
(:data:`trainstream.contract.OX_CUDA_LINES`, the same storage): :mod:`trainstream.contract._optax_cuda`'s lines, one
for one, in IEEE arithmetic (XLA:GPU approximates the square root, ``rsqrt`` and division)."""

from __future__ import annotations

import math

import numpy as np

from .. import _cpu_sqrt, _jit, contract
from .._jit import source_stamp
from ..contract import (OX_B1_HALF, OX_B2_HALF, OX_CLIP, OX_FORM_R, OX_HALF, OX_HALF_DIV, OX_MU_BF16, OX_MU_F32,
                        OX_MU_SWAP, OX_NESTEROV, OX_NO_FMA, OX_NU_SWAP, OX_RSQRT, OX_RSQRT_DIV, S_BC1, S_BC1_NEXT,
                        S_BC2_OPTAX, S_BETA1, S_BETA1_MU, S_BETA2, S_CLIP, S_CLIP_DIV, S_EPS, S_EPS_ROOT, S_NEG_LR,
                        S_OMB1, S_OMB2, S_OX_CODE, S_WD, VARIANT_OPTAX_CPU)
from . import _ops
from ._ops import AHEAD, KIND_BF16, KIND_F16, KIND_F32, LINE, OPTS, STRIP, ftz, load, mad_xla, njit, prefetch_r, \
    prefetch_w, round16, round_xla, rsqrt_estimate, rt, rx, select

#: ``okind`` that writes the rounded weights back into the fp16/bf16 gradient buffer (``out16 is g``): a kernel
#: of its own, as overlapping array arguments fail LLVM's run-time alias check (scalar loop, ~6x slower).
OUT_IN_GRAD = 3
#: ``okind`` (optax) that writes the contract's ``u`` (the update before the learning rate) into a float32
#: ``out``, ``p`` unwritten (the JAX adapter's ``update``: its XLA program applies ``-lr`` as optax does).
OUT_U = 4

#: The source stamp of the modules whose globals the kernels use (:func:`trainstream._jit.source_stamp`; the
#: contract's constants are defined in its ``_scalars``).
_DEPS = source_stamp(_jit, _cpu_sqrt, contract, contract._scalars, _ops)


def build_adamw(variant: int, gkind: int, okind: int, mode: int = 0, cache: bool = True):
    """The optax specialisation of ``(variant, gkind, okind, mode)``; ``mode``: the optax/cpu code, or the optax/cuda
    code without ``OX_CLIP`` (read at run time)."""
    optax_cpu = variant == VARIANT_OPTAX_CPU
    cu = 0 if optax_cpu else mode  # optax/cuda's lines
    cu_half, cu_mu32, cu_mu16, cu_nesterov, cu_rsqrt = (
        (cu & b) != 0 for b in (OX_HALF, OX_MU_F32, OX_MU_BF16, OX_NESTEROV, OX_RSQRT))
    ox = mode if optax_cpu else 0  # ox_unfused: XLA:CPU without FMA3, every contracted line two roundings, each flushed
    ox_unfused, ox_form_r, ox_clip, ox_mu_swap, ox_nu_swap = (
        (ox & b) != 0 for b in (OX_NO_FMA, OX_FORM_R, OX_CLIP, OX_MU_SWAP, OX_NU_SWAP))
    nesterov, rsqrt, rsqrt_div, b1_half, b2_half = (
        (ox & b) != 0 for b in (OX_NESTEROV, OX_RSQRT, OX_RSQRT_DIV, OX_B1_HALF, OX_B2_HALF))
    half, mu_f32, mu_bf16 = (ox & OX_HALF) != 0, (ox & OX_MU_F32) != 0, (ox & OX_MU_BF16) != 0
    hdiv = (ox & OX_HALF_DIV) != 0  # one-element fp16/bf16 leaf: x / d, not x * (1/d)
    decay_last = contract.optax_rsqrt_decay_last(ox)  # rsqrt with decay: fma(wd, p, RN(mh*rs))
    num_swap = (ox & contract.OX_NUM_SWAP) != 0  # nesterov's numerator: fma(1-b1, gn, RN(b1*mn))
    pure = half and not mu_f32  # params, mu, nu in the leaf's dtype
    mixed = half and mu_f32
    dk = gkind  # the leaf's kind (fp16/bf16 state)
    bf16 = dk == KIND_BF16
    mkind = KIND_BF16 if mu_bf16 else dk if pure else KIND_F32
    in_grad = okind == OUT_IN_GRAD  # the rounded weights overwrite g[i] (read just before)
    emit_u = okind == OUT_U  # u into out (float32), p read only
    write16 = okind == KIND_F16 or okind == KIND_BF16
    rkind = gkind if in_grad else okind  # the format the weights are rounded to
    deps = _DEPS

    @njit(key=(variant, gkind, okind, mode), **dict(OPTS, cache=cache))
    def adamw_kernel(p, m, v, g, out16, begin, end, s):
        deps  # noqa: B018 (in the closure: the cache key)
        c, div = s[S_CLIP], s[S_CLIP_DIV]
        omb1, b2, omb2, eps = s[S_OMB1], s[S_BETA2], s[S_OMB2], s[S_EPS]
        b1, bc1, bc2, wd, neg_lr = s[S_BETA1], s[S_BC1], s[S_BC2_OPTAX], s[S_WD], s[S_NEG_LR]
        # optax/cpu: every scalar read with DAZ, as XLA:CPU reads it
        z_c, z_div = ftz(c), ftz(div)
        z_b1, z_omb1, z_b2, z_omb2 = ftz(b1), ftz(omb1), ftz(b2), ftz(omb2)
        z_d1, z_d2, z_eps, z_wd, z_neg_lr = ftz(bc1), ftz(bc2), ftz(eps), ftz(wd), ftz(neg_lr)
        z_d1n, z_er, z_b1mu = ftz(s[S_BC1_NEXT]), ftz(s[S_EPS_ROOT]), ftz(s[S_BETA1_MU])
        z_r1, z_r2 = ftz(np.float32(1.0) / z_d1), ftz(np.float32(1.0) / z_d2)  # form R: XLA's divide(1, 1 - b**t)
        z_r1n = ftz(np.float32(1.0) / z_d1n)
        if pure:  # the reciprocals of the corrections: float32 (bf16) or rounded to half (fp16)
            if bf16:
                z_r1, z_r2, z_r1n = z_r1, z_r2, z_r1n
            else:
                z_r1, z_r2, z_r1n = rx(z_r1, dk), rx(z_r2, dk), rx(z_r1n, dk)
        d1h, d2h = rx(z_d1, dk), rx(z_d2, dk)  # the corrections in the leaf's dtype (mixed, one element)
        r1f = z_r1  # mixed with form R: float32 mu times the float32 reciprocal of the float32 d1
        if mixed:
            z_r2 = z_r2 if bf16 else rx(z_r2, dk)
            r1d = ftz(np.float32(1.0) / rx(z_d1, dk))
            z_r1 = r1d if bf16 else rx(r1d, dk)
        r1b1 = rx(z_r1 * z_b1, dk) if pure else z_r1  # fp16 b1 == 0.5: the update recomputes m with RH(r1*b1)
        r2b2 = rx(z_r2 * z_b2, dk) if half else z_r2  # and b2 == 0.5 (fp16 mu too): v with RH(r2*b2)
        mb = z_b1mu if mu_bf16 else z_b1
        decays = z_wd != np.float32(0.0)
        has_er = z_er != np.float32(0.0)
        # optax/cuda with optax.clip_by_global_norm: g = (g / norm) * max_norm
        cuda_clip = (np.int64(s[S_OX_CODE]) & OX_CLIP) != 0
        stop = np.uint64(end)
        lo = np.uint64(begin)
        while lo < stop:  # strips of STRIP elements, prefetching AHEAD elements ahead
            hi = min(lo + STRIP, stop)
            for q in range(np.uint64(0), STRIP, LINE):
                j = lo + AHEAD + q
                prefetch_w(p, j)
                prefetch_w(m, j)
                prefetch_w(v, j)
                if in_grad:
                    prefetch_w(g, j)
                else:
                    prefetch_r(g, j)
                if write16 or emit_u:
                    prefetch_w(out16, j)
            for i in range(lo, hi):
                if pure:  # fp16/bf16 state: every operation rounded to the dtype, no FMA
                    gi = ftz(load(g[i], dk))
                    pi = ftz(load(p[i], dk))
                    mo = ftz(load(m[i], dk))
                    vo = ftz(load(v[i], dk))
                    if b1_half:
                        mi = rx(rx(gi + mo, dk) * z_b1, dk)
                    else:
                        mi = rx(rx(z_omb1 * gi, dk) + rx(z_b1 * mo, dk), dk)
                    gg = rx(gi * gi, dk)
                    if b2_half:
                        vi = rx(rx(gg + vo, dk) * z_b2, dk)
                    else:
                        vi = rx(rx(z_omb2 * gg, dk) + rx(z_b2 * vo, dk), dk)
                    if b2_half and not bf16:  # the update's loop recomputes v: (gg + v_old) * RH(r2*b2)
                        vh = rx(rx(gg + vo, dk) * r2b2, dk)
                    elif hdiv:
                        vh = rx(vi / z_d2, dk)
                    else:
                        vh = rx(vi * z_r2, dk)
                    vh = select(has_er, rx(vh + z_er, dk), vh)
                    if nesterov and hdiv:
                        num = rx(rx(z_b1 * rx(mi / z_d1n, dk), dk) + rx(z_omb1 * rx(gi / z_d1, dk), dk), dk)
                    elif nesterov:
                        num = rx(rx(z_b1 * rx(mi * z_r1n, dk), dk) + rx(z_omb1 * rx(gi * z_r1, dk), dk), dk)
                    elif b1_half and not bf16:
                        num = rx(rx(gi + mo, dk) * r1b1, dk)
                    elif hdiv:
                        num = rx(mi / z_d1, dk)
                    else:
                        num = rx(mi * z_r1, dk)
                    if rsqrt:
                        u = rx(num * rx(np.float32(1.0) / ftz(np.float32(math.sqrt(vh))), dk), dk)
                    elif hdiv and not bf16 and not nesterov and not b1_half:  # XLA: (m/d1)/den -> m/(d1*den)
                        u = rx(mi / rx(z_d1 * rx(rx(np.float32(math.sqrt(vh)), dk) + z_eps, dk), dk), dk)
                    else:
                        u = rx(num / rx(rx(np.float32(math.sqrt(vh)), dk) + z_eps, dk), dk)
                    u = select(decays, rx(u + rx(z_wd * pi, dk), dk), u)
                    pi = rx(pi + rx(u * z_neg_lr, dk), dk)
                    m[i] = round_xla(mi, dk)
                    v[i] = round_xla(vi, dk)
                    if emit_u:
                        out16[i] = round_xla(u, dk)
                    else:
                        p[i] = round_xla(pi, dk)
                elif mixed:  # fp16/bf16 params and nu, float32 mu
                    gi = ftz(load(g[i], dk))
                    pi = ftz(load(p[i], dk))
                    mo = ftz(m[i])
                    vo = ftz(load(v[i], dk))
                    if bf16:
                        if ox_mu_swap:
                            mi = ftz(mad_xla(ox_unfused, z_omb1, gi, ftz(z_b1 * mo)))
                        else:
                            mi = ftz(mad_xla(ox_unfused, z_b1, mo, ftz(z_omb1 * gi)))
                    else:
                        mi = ftz(mad_xla(ox_unfused, z_b1, mo, rx(z_omb1 * gi, dk)))
                    gg = rx(gi * gi, dk)
                    if b2_half:
                        vi = rx(rx(gg + vo, dk) * z_b2, dk)
                    else:
                        vi = rx(rx(z_omb2 * gg, dk) + rx(z_b2 * vo, dk), dk)
                    if b2_half and not bf16:  # the update's loop recomputes v: (gg + v_old) * RH(r2*b2)
                        vh = rx(rx(gg + vo, dk) * r2b2, dk)
                    elif hdiv:
                        vh = rx(vi / d2h, dk)
                    else:
                        vh = rx(vi * z_r2, dk)
                    vh = select(has_er, rx(vh + z_er, dk), vh)
                    sq = rx(np.float32(math.sqrt(vh)), dk)
                    den = ftz(sq + z_eps) if bf16 else rx(sq + z_eps, dk)
                    if nesterov:
                        gn = rx(gi / d1h, dk) if hdiv else rx(gi * z_r1, dk)
                        cg = ftz(z_omb1 * gn) if bf16 else rx(z_omb1 * gn, dk)
                        mn = ftz(mi * z_r1n) if ox_form_r else ftz(mi / z_d1n)
                        u = ftz(ftz(mad_xla(ox_unfused, z_b1, mn, cg)) / den)
                    elif ox_form_r:
                        u = ftz(ftz(mi * r1f) / den)
                    else:
                        u = ftz(mi / ftz(z_d1 * den))
                    if bf16:
                        u = select(decays, ftz(mad_xla(ox_unfused, z_wd, pi, u)), u)
                    else:
                        u = select(decays, ftz(u + rx(z_wd * pi, dk)), u)
                    m[i] = mi
                    v[i] = round_xla(vi, dk)
                    if emit_u:
                        out16[i] = u
                    else:
                        p[i] = round_xla(ftz(mad_xla(ox_unfused, z_neg_lr, u, pi)), dk)
                elif optax_cpu:  # XLA:CPU: FTZ/DAZ on every operation, FMA where LLVM fused
                    gi = ftz(load(g[i], gkind))
                    gi = ftz(ftz(gi / z_div) * z_c) if ox_clip else ftz(gi * z_c)
                    pi = ftz(p[i])
                    mo = ftz(load(m[i], mkind))
                    vo = ftz(v[i])
                    if b1_half and not mu_bf16:  # (mu_dtype=bfloat16: nesterov's numerator only)
                        mi = ftz(ftz(gi + mo) * z_b1)
                    elif ox_mu_swap:
                        mi = ftz(mad_xla(ox_unfused, mb, mo, ftz(z_omb1 * gi)))
                    else:
                        mi = ftz(mad_xla(ox_unfused, z_omb1, gi, ftz(mb * mo)))
                    if b2_half:
                        vi = ftz(ftz(mad_xla(ox_unfused, gi, gi, vo)) * z_b2)
                    else:
                        gg = ftz(gi * gi)
                        if ox_nu_swap:
                            vi = ftz(mad_xla(ox_unfused, z_b2, vo, ftz(z_omb2 * gg)))
                        else:
                            vi = ftz(mad_xla(ox_unfused, z_omb2, gg, ftz(z_b2 * vo)))
                    if ox_form_r:  # LLVM contracts v*r2 + eps_root
                        vh = select(has_er, ftz(mad_xla(ox_unfused, vi, z_r2, z_er)), ftz(vi * z_r2))
                    else:
                        vh = select(has_er, ftz(ftz(vi / z_d2) + z_er), ftz(vi / z_d2))
                    if nesterov:
                        mn = ftz(mi * z_r1n) if ox_form_r else ftz(mi / z_d1n)
                        gn = ftz(gi * z_r1) if ox_form_r else ftz(gi / z_d1)
                        if b1_half and ox_form_r:  # XLA: (mn + gn) * b1, g*r1 contracted into the sum
                            num = ftz(ftz(mad_xla(ox_unfused, gi, z_r1, mn)) * z_b1)
                        elif b1_half:
                            num = ftz(ftz(mn + gn) * z_b1)
                        elif num_swap:
                            num = ftz(mad_xla(ox_unfused, z_omb1, gn, ftz(z_b1 * mn)))
                        else:
                            num = ftz(mad_xla(ox_unfused, z_b1, mn, ftz(z_omb1 * gn)))
                        u = ftz(num / ftz(ftz(np.float32(math.sqrt(vh))) + z_eps))
                    elif rsqrt:  # m / sqrt(v) -> m * rsqrt(v) (with decay: the contract's note on its pairing)
                        mh = ftz(mi * z_r1) if ox_form_r else ftz(mi / z_d1)
                        x = vh
                        if rsqrt_div:
                            rs = ftz(np.float32(1.0) / ftz(np.float32(math.sqrt(x))))
                        else:
                            y0 = rsqrt_estimate(x)
                            e = ftz(mad_xla(ox_unfused, y0, ftz(y0 * x), np.float32(-1.0)))
                            y1 = ftz(mad_xla(ox_unfused, ftz(np.float32(-0.5) * y0), e, y0))
                            rs = select((x < np.float32(1.1754943508222875e-38)) | (x == np.float32(np.inf)), y0, y1)
                        if decay_last:  # the decay below, fma(wd, p, u)
                            u = ftz(mh * rs)
                        else:
                            u = select(decays, ftz(mad_xla(ox_unfused, mh, rs, ftz(z_wd * pi))), ftz(mh * rs))
                    elif ox_form_r:
                        den = ftz(np.float32(math.sqrt(vh)) + z_eps)
                        u = ftz(ftz(mi * z_r1) / den)
                    else:
                        den = ftz(np.float32(math.sqrt(vh)) + z_eps)
                        u = ftz(mi / ftz(z_d1 * den))
                    if not rsqrt or nesterov or decay_last:
                        u = select(decays, ftz(mad_xla(ox_unfused, z_wd, pi, u)), u)
                    pi = ftz(mad_xla(ox_unfused, z_neg_lr, u, pi))
                    if mu_bf16:
                        m[i] = round_xla(mi, KIND_BF16)
                    else:
                        m[i] = mi
                    v[i] = vi
                elif cu_half:  # optax/cuda, fp16/bf16 state: every operation rounded to the dtype (rt), no FTZ
                    gi = load(g[i], dk)  # (no clipping with 16-bit state: refused by optax_cuda_code)
                    pi = load(p[i], dk)
                    vo = load(v[i], dk)
                    vi = rt(rt(rt(gi * gi, dk) * omb2, dk) + rt(vo * b2, dk), dk)
                    sq = np.float32(0.0) if cu_rsqrt else rt(np.float32(math.sqrt(vi / bc2)), dk)  # (rsqrt: below)
                    if cu_mu32:  # bf16 leaf, float32 mu: u float32
                        mi = rt(gi * omb1, dk) + m[i] * b1
                        u = mi / (bc1 * rt(sq + eps, dk))
                        u = u + rt(pi * wd, dk)
                        pi = rt(pi + u * neg_lr, dk)
                        m[i] = mi
                    else:
                        mi = rt(rt(gi * omb1, dk) + rt(load(m[i], dk) * b1, dk), dk)
                        if cu_rsqrt:  # XLA's m / sqrt(v) -> m * rsqrt(v)
                            rs = rt(np.float32(1.0) / np.float32(math.sqrt(rt(vi / rt(bc2, dk), dk))), dk)
                            u = rt(rt(mi / rt(bc1, dk), dk) * rs, dk)
                        elif cu_nesterov:
                            num = rt(rt(b1 * rt(mi / s[S_BC1_NEXT], dk), dk) + rt(omb1 * rt(gi / bc1, dk), dk), dk)
                            u = rt(num / rt(sq + eps, dk), dk)
                        else:
                            u = rt(mi / rt(rt(bc1, dk) * rt(sq + eps, dk), dk), dk)
                        u = rt(u + rt(pi * wd, dk), dk)
                        pi = rt(pi + rt(u * neg_lr, dk), dk)
                        m[i] = round16(mi, dk)
                    v[i] = round16(vi, dk)
                    if emit_u:
                        out16[i] = u if cu_mu32 else round16(u, dk)
                    else:
                        p[i] = round16(pi, dk)
                else:  # optax/cuda, float32 state (IEEE sqrt and division where XLA:GPU approximates)
                    graw = load(g[i], gkind)
                    gi = select(cuda_clip, (graw / div) * c, graw * c)
                    pi = p[i]
                    if cu_mu16:  # mu stored bfloat16, f(b1) m rounded to it
                        mi = omb1 * gi + rt(load(m[i], KIND_BF16) * s[S_BETA1_MU], KIND_BF16)
                    else:
                        mi = omb1 * gi + b1 * m[i]
                    vi = omb2 * (gi * gi) + b2 * v[i]
                    h = vi / bc2 + s[S_EPS_ROOT]  # eps_root 0: no bit
                    if cu_nesterov:
                        u = (b1 * (mi / s[S_BC1_NEXT]) + omb1 * (gi / bc1)) / (np.float32(math.sqrt(h)) + eps)
                    elif cu_rsqrt:
                        u = (mi / bc1) * (np.float32(1.0) / np.float32(math.sqrt(h)))
                    else:
                        u = mi / (bc1 * (np.float32(math.sqrt(h)) + eps))
                    u = u + wd * pi
                    pi = pi + u * neg_lr
                    m[i] = round16(mi, KIND_BF16) if cu_mu16 else mi
                    v[i] = vi
                if not (half or cu_half):
                    if emit_u:
                        out16[i] = u
                    else:
                        p[i] = pi
                    if write16:
                        out16[i] = round16(pi, okind)
                    elif in_grad:
                        g[i] = round16(pi, rkind)
            lo = hi
    return adamw_kernel


def _estimate_loop(x, out):
    for i in range(x.size):
        out[i] = rsqrt_estimate(x[i])


_estimate_kernel = None


def rsqrt_estimate_array(x) -> np.ndarray:
    """This CPU's ``rsqrtss`` estimate of each element of float32 ``x`` (the NumPy reference's ``estimate=``,
    :func:`trainstream.contract.xla_rsqrt`)."""
    global _estimate_kernel
    if _estimate_kernel is None:
        _estimate_kernel = njit(**dict(OPTS, cache=False))(_estimate_loop)
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = np.empty_like(x)
    _estimate_kernel(x, out)
    return out
