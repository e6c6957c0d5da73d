"""The optax kernel: the ``optax`` convention's update (:mod:`trainstream.contract`, cpu and cuda platforms) over
``[begin, end)`` of flat buffers, one compiled specialisation per key ``(variant, gkind, okind, code)``
(:func:`build_adamw`; the dispatch is the package's). ``okind``: 0 no weights out, 1/2 the new weights rounded to
fp16/bf16 into ``out16``, :data:`OUT_IN_GRAD` into the gradient buffer itself, :data:`OUT_U` the update ``u`` into a
float32 ``out`` (``p`` read only)."""

from __future__ import annotations

import math

import numpy as np

from .. import _cpu_sqrt, _jit, contract
from .._jit import source_stamp
from ..contract import (OX_CLIP, OX_FORM_R, OX_MU_SWAP, OX_NO_FMA, OX_NU_SWAP, S_BC1, S_BC2_OPTAX, S_BETA1, S_BETA2,
                        S_CLIP, S_CLIP_DIV, S_EPS, S_NEG_LR, S_OMB1, S_OMB2, S_OX_CODE, S_WD, VARIANT_OPTAX_CPU)
from . import _ops
from ._ops import AHEAD, KIND_BF16, KIND_F16, LINE, OPTS, STRIP, ftz, load, mad_xla, njit, prefetch_r, prefetch_w, \
    round16, select

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
    """The optax specialisation of ``(variant, gkind, okind, mode)``; ``mode``: the optax/cpu code (0 for cuda)."""
    optax_cpu = variant == VARIANT_OPTAX_CPU
    ox = mode if optax_cpu else 0  # ox_unfused: XLA:CPU without FMA3, every contracted line two roundings, each flushed
    ox_unfused, ox_form_r, ox_clip, ox_mu_swap, ox_nu_swap = (
        (ox & b) != 0 for b in (OX_NO_FMA, OX_FORM_R, OX_CLIP, OX_MU_SWAP, OX_NU_SWAP))
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
        z_r1, z_r2 = ftz(np.float32(1.0) / z_d1), ftz(np.float32(1.0) / z_d2)  # form R: XLA's divide(1, 1 - b**t)
        decays = z_wd != np.float32(0.0)
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
                if optax_cpu:  # XLA:CPU: FTZ/DAZ on every operation, FMA where LLVM fused
                    gi = ftz(load(g[i], gkind))
                    gi = ftz(ftz(gi / z_div) * z_c) if ox_clip else ftz(gi * z_c)
                    pi = ftz(p[i])
                    mo = ftz(m[i])
                    vo = ftz(v[i])
                    if ox_mu_swap:
                        mi = ftz(mad_xla(ox_unfused, z_b1, mo, ftz(z_omb1 * gi)))
                    else:
                        mi = ftz(mad_xla(ox_unfused, z_omb1, gi, ftz(z_b1 * mo)))
                    gg = ftz(gi * gi)
                    if ox_nu_swap:
                        vi = ftz(mad_xla(ox_unfused, z_b2, vo, ftz(z_omb2 * gg)))
                    else:
                        vi = ftz(mad_xla(ox_unfused, z_omb2, gg, ftz(z_b2 * vo)))
                    if ox_form_r:
                        den = ftz(np.float32(math.sqrt(ftz(vi * z_r2))) + z_eps)
                        q = ftz(ftz(mi * z_r1) / den)
                    else:
                        den = ftz(np.float32(math.sqrt(ftz(vi / z_d2))) + z_eps)
                        q = ftz(mi / ftz(z_d1 * den))
                    u = select(decays, ftz(mad_xla(ox_unfused, z_wd, pi, q)), q)
                    pi = ftz(mad_xla(ox_unfused, z_neg_lr, u, pi))
                else:  # optax/cuda (host emulation with IEEE sqrt and division)
                    graw = load(g[i], gkind)
                    gi = select(cuda_clip, (graw / div) * c, graw * c)
                    pi = p[i]
                    mi = omb1 * gi + b1 * m[i]
                    vi = omb2 * (gi * gi) + b2 * v[i]
                    u = mi / (bc1 * (np.float32(math.sqrt(vi / bc2)) + eps))
                    u = u + wd * pi
                    pi = pi + u * neg_lr
                m[i] = mi
                v[i] = vi
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
