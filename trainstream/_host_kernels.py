"""Numba host kernels: AdamW update, gradient accumulation, sum of squares.

The arithmetic of :func:`adamw_chunk` is the contract of :mod:`trainstream._contract`
(read it there; it is not restated here). Every kernel works on flat, contiguous 1-D
buffers over a half-open ``[begin, end)`` range so that worker threads can run disjoint
chunks of one parameter in parallel; all are compiled with ``nogil=True`` (the GIL is
released while they run) and cached on disk.

Element types. Numba has no bfloat16 and its float16 support on the CPU is partial, so
half-precision buffers are passed as their ``uint16`` bit patterns with a *kind* code:

=====  ==========================
kind   meaning of a uint16 buffer
=====  ==========================
0      (float32 buffer, no code)
1      IEEE float16
2      bfloat16
=====  ==========================

Conversions to float32 are exact; conversions from float32 round to nearest even and
keep Inf and NaN, bit-identical to ``c10::Half``/``c10::BFloat16`` (NaN becomes the
canonical quiet NaN). No kernel uses fast-math: LLVM may not contract ``a*b + c``; the
FMA instruction appears only through :func:`fma32`, exactly where the contract has it.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ._contract import (
    S_BC1,
    S_BC2,
    S_BC2_OPTAX,
    S_BETA1,
    S_BETA2,
    S_CLIP,
    S_DECAY,
    S_EPS,
    S_LERP_SMALL,
    S_LERP_W,
    S_NEG_LR,
    S_NEG_STEP,
    S_OMB1,
    S_OMB2,
    S_WD,
    VARIANT_OPTAX_CPU,
    VARIANT_OPTAX_CUDA,
    VARIANT_TORCH_CPU,
    VARIANT_TORCH_CUDA,
)

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2

_OPTS = dict(nogil=True, cache=True, error_model="numpy", boundscheck=False)


@intrinsic
def fma32(typingctx, a, b, c):
    """``a*b + c`` with one rounding (``llvm.fma.f32``), for float32 operands."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _bits_f32(typingctx, x):
    """Reinterpret a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _f32_bits(typingctx, u):
    """Reinterpret a uint32 as float32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


# -- half-precision conversions (on bit patterns) ------------------------------------------


@njit(inline="always", **_OPTS)
def bf16_to_f32(h):
    return _f32_bits(np.uint32(h) << np.uint32(16))


@njit(inline="always", **_OPTS)
def f32_to_bf16(x):
    u = _bits_f32(x)
    if x != x:  # NaN -> canonical quiet NaN, as c10::BFloat16
        return np.uint16(0x7FC0)
    return np.uint16((u + (((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))) >> np.uint32(16))


@njit(inline="always", **_OPTS)
def f16_to_f32(h):
    # Branch-free IEEE half -> float (as c10::detail::fp16_ieee_to_fp32_value).
    w = np.uint32(h) << np.uint32(16)
    sign = w & np.uint32(0x80000000)
    two_w = np.uint32(w + w)  # numba widens integer arithmetic: wrap to 32 bits
    normalized = _f32_bits((two_w >> np.uint32(4)) + np.uint32(0xE0 << 23)) * np.float32(1.925929944387236e-34)
    denormalized = _f32_bits((two_w >> np.uint32(17)) | np.uint32(126 << 23)) - np.float32(0.5)
    if two_w < np.uint32(1 << 27):
        r = _bits_f32(denormalized)
    else:
        r = _bits_f32(normalized)
    return _f32_bits(sign | r)


@njit(inline="always", **_OPTS)
def f32_to_f16(x):
    # Round to nearest even (as c10::detail::fp16_ieee_from_fp32_value).
    base = (abs(x) * np.float32(5.192296858534828e33)) * np.float32(7.703719777548943e-34)
    w = _bits_f32(x)
    shl1_w = np.uint32(w + w)  # wrap to 32 bits
    sign = w & np.uint32(0x80000000)
    bias = shl1_w & np.uint32(0xFF000000)
    if bias < np.uint32(0x71000000):
        bias = np.uint32(0x71000000)
    base = _f32_bits((bias >> np.uint32(1)) + np.uint32(0x07800000)) + base
    b = _bits_f32(base)
    exp_bits = (b >> np.uint32(13)) & np.uint32(0x00007C00)
    mantissa_bits = b & np.uint32(0x00000FFF)
    nonsign = exp_bits + mantissa_bits
    if shl1_w > np.uint32(0xFF000000):
        nonsign = np.uint32(0x7E00)
    return np.uint16((sign >> np.uint32(16)) | nonsign)


@njit(inline="always", **_OPTS)
def load_f32(buf, i, kind):
    """Element ``i`` of a float32 buffer or of a uint16 buffer of ``kind``, as float32."""
    x = buf[i]
    if kind == KIND_F16:
        return f16_to_f32(x)
    if kind == KIND_BF16:
        return bf16_to_f32(x)
    return np.float32(x)


@njit(inline="always", **_OPTS)
def store_16(out, i, x, kind):
    if kind == KIND_F16:
        out[i] = f32_to_f16(x)
    elif kind == KIND_BF16:
        out[i] = f32_to_bf16(x)


# -- sqrt of the torch/cpu convention --------------------------------------------------------


@njit(inline="always", **_OPTS)
def torch_cpu_sqrt(x):
    """``Tensor.sqrt()`` on a float32 CPU tensor, as the contract defines it."""
    return np.float32(math.sqrt(x))


# -- AdamW ----------------------------------------------------------------------------------


@njit(**_OPTS)
def adamw_chunk(variant, p, m, v, g, gkind, out16, okind, begin, end, s):
    """One AdamW update of elements ``[begin, end)``; see :mod:`trainstream._contract`.

    ``p`` fp32 master (updated in place), ``m``/``v`` fp32 moments (in place), ``g`` the
    gradient (float32, or uint16 bits of ``gkind``), ``out16`` receives the new weights
    rounded to ``okind`` (1 fp16, 2 bf16; 0: not written), ``s`` the float32 scalars.
    """
    c = s[S_CLIP]
    if variant == VARIANT_TORCH_CPU or variant == VARIANT_TORCH_CUDA:
        decay = s[S_DECAY]
        w = s[S_LERP_W]
        small = s[S_LERP_SMALL] != np.float32(0.0)
        wm1 = w - np.float32(1.0)
        b2 = s[S_BETA2]
        omb2 = s[S_OMB2]
        bc2 = s[S_BC2]
        eps = s[S_EPS]
        neg_step = s[S_NEG_STEP]
        cpu = variant == VARIANT_TORCH_CPU
        for i in range(begin, end):
            gi = load_f32(g, i, gkind) * c  # g = g * c
            mi = m[i]
            pi = p[i] * decay  # p1 = p * f(1 - lr*wd)
            if small:  # lerp(m, g, w)
                mi = fma32(w, gi - mi, mi)
            else:
                mi = fma32(wm1, gi - mi, gi)
            if cpu:
                vi = fma32(omb2 * gi, gi, v[i] * b2)  # addcmul on the CPU
                d = torch_cpu_sqrt(vi) / bc2 + eps
                pi = pi + (neg_step * mi) / d  # addcdiv on the CPU
            else:
                vi = fma32(omb2, gi * gi, v[i] * b2)  # addcmul on CUDA
                d = np.float32(math.sqrt(vi)) * bc2 + eps
                pi = fma32(neg_step, mi / d, pi)  # addcdiv on CUDA
            m[i] = mi
            v[i] = vi
            p[i] = pi
            store_16(out16, i, pi, okind)
    elif variant == VARIANT_OPTAX_CPU or variant == VARIANT_OPTAX_CUDA:
        omb1 = s[S_OMB1]
        b1 = s[S_BETA1]
        omb2 = s[S_OMB2]
        b2 = s[S_BETA2]
        bc1 = s[S_BC1]
        bc2 = s[S_BC2_OPTAX]
        eps = s[S_EPS]
        wd = s[S_WD]
        neg_lr = s[S_NEG_LR]
        for i in range(begin, end):
            gi = load_f32(g, i, gkind) * c
            pi = p[i]
            mi = omb1 * gi + b1 * m[i]
            vi = omb2 * (gi * gi) + b2 * v[i]
            u = mi / (bc1 * (np.float32(math.sqrt(vi / bc2)) + eps))
            u = u + wd * pi
            pi = pi + u * neg_lr
            m[i] = mi
            v[i] = vi
            p[i] = pi
            store_16(out16, i, pi, okind)
    else:
        raise ValueError("adamw_chunk: unknown variant")


# -- accumulation and sum of squares -------------------------------------------------------


@njit(**_OPTS)
def accumulate_chunk(acc, g, gkind, begin, end, fresh):
    """``acc[i] = g[i]`` (``fresh``) or ``acc[i] += g[i]`` in float32 over ``[begin, end)``."""
    if fresh:
        for i in range(begin, end):
            acc[i] = load_f32(g, i, gkind)
    else:
        for i in range(begin, end):
            acc[i] = acc[i] + load_f32(g, i, gkind)


@njit(**_OPTS)
def sumsq_blocks(g, gkind, begin, end, block, out):
    """Float64 sums of squares of ``g`` over the fixed blocks ``[k*block, (k+1)*block)``.

    ``begin`` must be a multiple of ``block``; ``out[k - begin // block]`` receives block
    ``k``. Blocks are fixed in element space, so the partials (and any sum of them taken
    in block order) do not depend on how ``[0, n)`` was cut into chunks.
    """
    k0 = begin // block
    k = k0
    start = begin
    while start < end:
        stop = min(start + block, end)
        acc = 0.0
        for i in range(start, stop):
            x = np.float64(load_f32(g, i, gkind))
            acc += x * x
        out[k - k0] = acc
        k += 1
        start = stop


@njit(**_OPTS)
def convert_to_f32(dst, src, kind, begin, end):
    """``dst[i] = float32(src[i])`` (exact) over ``[begin, end)``."""
    for i in range(begin, end):
        dst[i] = load_f32(src, i, kind)


@njit(**_OPTS)
def round_from_f32(dst, src, kind, begin, end):
    """``dst[i] = round(src[i])`` to ``kind`` bits (1 fp16, 2 bf16) over ``[begin, end)``."""
    for i in range(begin, end):
        store_16(dst, i, src[i], kind)
