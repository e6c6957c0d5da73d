"""The torch kernel: every :class:`~trainstream.contract.TorchRecipe`'s update (the package docstring of
:mod:`trainstream.contract`, "torch") over ``[begin, end)`` of flat buffers, and the fp32 gradient sums of the
master scheme (:func:`build_accumulate`).

One compiled specialisation per key ``(family, mkind, wkind, gkind, layout, amsgrad, code)``: what changes the
memory layout or the per-element operations. ``family``: the index in :data:`~trainstream.contract.FAMILIES`;
``mkind``: the math (and state) dtype's kind; ``wkind``: the weights' (the parameter's) kind; ``gkind``: the
gradient buffer's; ``layout``: where the weights live (:data:`W_NONE`: ``p``, float32; :data:`W_OUT`: the fp32
master ``p``, the rounded weights written into ``w``; :data:`W_IN_GRAD`: the same into the gradient buffer;
:data:`W_SELF`: no master, ``w`` holds the fp16/bf16 weights, read and written); ``amsgrad``: a ``vmax`` buffer;
``code``: the torch/cpu code's sqrt mode (CPU float32 single/foreach only) and :data:`~trainstream.contract.TC_NO_FMA`.
Everything else is a runtime scalar of the vector ``s`` (L2 or decoupled decay, ``maximize``, foreach's cast scalars,
Tensor ``lr``, GradScaler's division) chosen per element by ``select``, or the argument ``tail`` (the chunk lies in
torch's scalar tail: the caller splits chunks at :func:`~trainstream.contract.torch_cpu_tails`)."""

from __future__ import annotations

import math

import numpy as np

from .. import _cpu_sqrt, _jit, contract
from .._cpu_sqrt import IEEE as SQRT_IEEE
from .._cpu_sqrt import require_mode, torch_cpu_sqrt, torch_cpu_sqrt_block
from .._jit import source_stamp
from ..contract import (S_BETA1, S_BETA2, S_CLIP, S_DECAY, S_EPS, S_GRAD_DIV, S_INV_SQRT_BC2, S_L2, S_LERP_SMALL,
                        S_NEG_LR_WD, S_NEG_STEP, S_OMB1, S_OMB2, S_SQRT_BC2, TC_NO_FMA)
from . import _ops
from ._ops import (AHEAD, KIND_F32, LINE, OPTS, STRIP, fma32, load, mad, max_nan, njit, prefetch_r, prefetch_w,
                   round16, rt, select)

FAM_CPU_DEFAULT, FAM_CPU_FUSED, FAM_CUDA_FOREACH, FAM_CUDA_SINGLE, FAM_CUDA_FUSED = range(5)
W_NONE, W_OUT, W_IN_GRAD, W_SELF = range(4)

_DEPS = source_stamp(_jit, _cpu_sqrt, contract, contract._scalars, _ops)


def build_torch(fam: int, mkind: int, wkind: int, gkind: int, layout: int, amsgrad: int, code: int,
                cache: bool = True):
    """The specialisation of one key (module docstring); ``cache=False``: an uncached copy (machine code)."""
    cpu = fam in (FAM_CPU_DEFAULT, FAM_CPU_FUSED)
    fused = fam in (FAM_CPU_FUSED, FAM_CUDA_FUSED)
    cpu_fused, cuda_fused, single = fam == FAM_CPU_FUSED, fam == FAM_CUDA_FUSED, fam == FAM_CUDA_SINGLE
    cuda_per_op = fam in (FAM_CUDA_FOREACH, FAM_CUDA_SINGLE)
    m16, g16 = mkind != KIND_F32, gkind != KIND_F32
    sqrt_mode = (code & ~TC_NO_FMA) if fam == FAM_CPU_DEFAULT and not m16 else SQRT_IEEE
    require_mode(sqrt_mode)  # only this mode's instructions reach LLVM
    unfused = cpu and (code & TC_NO_FMA) != 0  # ATen's DEFAULT kernels: every fma two roundings
    blocked = sqrt_mode != SQRT_IEEE  # MKL's root, taken 16 lanes at a time
    l2_two16 = fam == FAM_CPU_DEFAULT and m16  # c10 Half/BFloat16 ops in the scalar tails (DEFAULT: everywhere)
    rk = KIND_F32 if fused else mkind  # what one op rounds to: per-op families round every result
    w_self, w_out, in_grad = layout == W_SELF, layout == W_OUT, layout == W_IN_GRAD
    ams = amsgrad != 0
    strip = int(STRIP)
    deps = _DEPS

    @njit(key=(fam, mkind, wkind, gkind, layout, amsgrad, code), **dict(OPTS, cache=cache))
    def torch_kernel(p, w, m, v, vmax, g, begin, end, s, tail):
        deps  # noqa: B018 (in the closure: the cache key)
        c = s[S_CLIP]
        round_g = g16 and c != np.float32(1.0)  # g * 1 is exact: nothing to round
        gdiv = s[S_GRAD_DIV]
        has_div = fused and gdiv != np.float32(0.0) and gdiv != np.float32(1.0)
        l2, decay, nlw = s[S_L2], s[S_DECAY], s[S_NEG_LR_WD]
        has_l2, has_nlw = l2 != np.float32(0.0), nlw != np.float32(0.0)
        # CUDA fused Adam-L2 with maximize, no amsgrad, no GradScaler: RN(g + RN(p*wd)) (kernels/adamw_torch.cu)
        l2_two = cuda_fused and not ams and not has_div and c < np.float32(0.0)
        small = s[S_LERP_SMALL] != np.float32(0.0)
        omb1 = s[S_OMB1]
        wl = omb1 if small else omb1 - np.float32(1.0)  # lerp: fma(w, g - m, m) | fma(w - 1, g - m, g)
        b1, b2, omb2 = s[S_BETA1], s[S_BETA2], s[S_OMB2]
        nb1, nb2 = -b1, -b2
        sqrt_bc2, inv, eps, neg = s[S_SQRT_BC2], s[S_INV_SQRT_BC2], s[S_EPS], s[S_NEG_STEP]
        tl = tail
        root = np.empty(strip, np.float32)  # the strip's square roots (blocked only)
        stop = np.uint64(end)
        lo = np.uint64(begin)
        while lo < stop:  # strips of STRIP elements, prefetching AHEAD elements ahead
            hi = min(lo + STRIP, stop)
            for q in range(np.uint64(0), STRIP, LINE):
                j = lo + AHEAD + q
                prefetch_w(m, j)
                prefetch_w(v, j)
                if ams:
                    prefetch_w(vmax, j)
                if in_grad:
                    prefetch_w(g, j)
                else:
                    prefetch_r(g, j)
                if w_self or w_out:
                    prefetch_w(w, j)
                if not w_self:
                    prefetch_w(p, j)
            if blocked:  # CPU float32 single/foreach with MKL's root: three passes over the strip
                for i in range(lo, hi):
                    gi = load(g[i], gkind) * c
                    if round_g:
                        gi = rt(gi, gkind)
                    if has_l2:
                        gi = mad(unfused, p[i], l2, gi)
                    mo = m[i]
                    m[i] = mad(unfused, wl, gi - mo, select(small, mo, gi))
                    vi = mad(unfused, omb2 * gi, gi, v[i] * b2)
                    v[i] = vi
                    if ams:
                        vmax[i] = max_nan(vmax[i], vi)
                if ams:
                    torch_cpu_sqrt_block(vmax, np.int64(lo), np.int64(hi - lo), root, sqrt_mode)
                else:
                    torch_cpu_sqrt_block(v, np.int64(lo), np.int64(hi - lo), root, sqrt_mode)
                for i in range(lo, hi):
                    d = root[i - lo] / sqrt_bc2 + eps
                    pn = p[i] * decay + (neg * m[i]) / d
                    p[i] = pn
                    if w_out:
                        w[i] = round16(pn, wkind)
                    elif in_grad:
                        g[i] = round16(pn, wkind)
                lo = hi
                continue
            for i in range(lo, hi):
                gi = load(g[i], gkind) * c  # g = r_g(g * c); c < 0: maximize
                if round_g:  # (loop-invariant: LLVM unswitches the loop)
                    gi = rt(gi, gkind)
                if has_div:  # GradScaler's scale
                    gi = gi / gdiv
                if w_self:
                    pi = load(w[i], mkind)
                else:
                    pi = p[i]
                mo = load(m[i], mkind)
                vo = load(v[i], mkind)
                if l2_two16:  # Adam's L2: vector fmadd, or c10 ops in a scalar tail
                    two = rt(gi + rt(l2 * pi, mkind), mkind)
                    if unfused:
                        gl = two
                    else:
                        gl = select(tl, two, rt(fma32(pi, l2, gi), mkind))
                elif cuda_per_op:
                    gl = rt(fma32(l2, pi, gi), mkind)
                elif cuda_fused:
                    gl = select(l2_two, gi + pi * l2, fma32(pi, l2, gi))
                else:
                    gl = mad(unfused, pi, l2, gi)
                if has_l2:  # (loop-invariant)
                    gi = gl
                if cuda_fused:
                    p1 = select(has_nlw, fma32(nlw, pi, pi), pi)  # param -= lr*wd*param
                    mi = fma32(b1, mo, fma32(nb1, gi, gi))
                    gg = gi * gi
                    vi = fma32(b2, vo, fma32(nb2, gg, gg))
                else:
                    p1 = rt(pi * decay, rk)
                    mi = rt(mad(unfused, wl, gi - mo, select(small, mo, gi)), rk)  # lerp
                    if cpu_fused:  # vector loop | scalar tail (GCC's contraction)
                        vi = select(tl, mad(unfused, vo, b2, (omb2 * gi) * gi), mad(unfused, omb2 * gi, gi, vo * b2))
                    elif cuda_per_op:
                        vi = rt(fma32(omb2, gi * gi, rt(vo * b2, rk)), rk)
                    else:
                        vi = rt(mad(unfused, omb2 * gi, gi, rt(vo * b2, rk)), rk)
                src = vi
                xi = vi
                if ams:
                    xo = load(vmax[i], mkind)
                    if cuda_fused:
                        xi = select(xo < vi, vi, xo)  # std::max
                    elif cpu_fused:
                        xi = select(tl, select(xo < vi, vi, xo), max_nan(xo, vi))
                    else:
                        xi = max_nan(xo, vi)  # torch.maximum
                    src = xi
                if fused:
                    d = np.float32(math.sqrt(src)) / sqrt_bc2 + eps
                elif fam == FAM_CPU_DEFAULT and not m16:
                    d = torch_cpu_sqrt(src, sqrt_mode) / sqrt_bc2 + eps  # (IEEE mode: MKL's is blocked)
                else:
                    qr = rt(np.float32(math.sqrt(src)), rk)
                    if single:
                        qd = rt(qr * inv, rk)  # CUDA: a CPU scalar divides as a reciprocal multiply
                    else:
                        qd = rt(qr / sqrt_bc2, rk)
                    d = rt(qd + eps, rk)
                if cuda_per_op:
                    pn = rt(fma32(neg, mi / d, p1), rk)  # addcdiv on CUDA
                else:
                    pn = rt(p1 + (neg * mi) / d, rk)
                if m16:
                    m[i] = round16(mi, mkind)
                    v[i] = round16(vi, mkind)
                    if ams:
                        vmax[i] = round16(xi, mkind)
                else:
                    m[i] = mi
                    v[i] = vi
                    if ams:
                        vmax[i] = xi
                if w_self:
                    w[i] = round16(pn, mkind)
                else:
                    p[i] = pn
                    if w_out:
                        w[i] = round16(pn, wkind)
                    elif in_grad:
                        g[i] = round16(pn, wkind)
            lo = hi
    return torch_kernel


def build_accumulate(gkind: int, cache: bool = True):
    """``acc[i] = g[i]`` (``fresh``) or ``acc[i] + g[i]`` over ``[begin, end)``: the master scheme's fp32 sums of the
    micro-batch gradients (float32 ``acc``; ``g`` of ``gkind``, upcast exactly), as TrainStream 0.1.1 summed them."""
    deps = _DEPS

    @njit(key=(gkind,), **dict(OPTS, cache=cache))
    def accumulate_kernel(acc, g, begin, end, fresh):
        deps  # noqa: B018 (in the closure: the cache key)
        for i in range(np.uint64(begin), np.uint64(end)):
            gi = load(g[i], gkind)
            acc[i] = select(fresh, gi, acc[i] + gi)
    return accumulate_kernel
