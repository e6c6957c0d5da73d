"""What every host kernel is written with: LLVM intrinsics (branch-free select, prefetch; ``fma32`` and the bit
casts are :mod:`trainstream._jit`'s), the exact half-precision conversions on bit patterns, and the per-element
helpers whose form a compile-time constant picks (``kind``: 0 float32, 1 IEEE float16, 2 bfloat16; ``unfused``).
All are plain Numba functions that LLVM inlines into the kernels: Numba's own ``inline="always"`` (its IR copied
into each call site, typed again) gave the same loops and compiled each kernel about 4x slower."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .._jit import OPTS as _JIT_OPTS
from .._jit import bits_f32 as _bits_f32
from .._jit import f32_bits as _f32_bits
from .._jit import fma32, njit

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
KINDS = (KIND_F32, KIND_F16, KIND_BF16)
OPTS = dict(_JIT_OPTS, boundscheck=False)

# The loops prefetch, before each strip of STRIP elements, the lines AHEAD elements ahead in every stream: with 7
# streams, hardware prefetch alone leaves a core short of memory-level parallelism (+5..10 % at 8 and 16 threads,
# measured on the 16-core Xeon host of the H200, 2**27 elements).
STRIP = np.uint64(64)
AHEAD = np.uint64(512)
LINE = np.uint64(16)  # float32 elements per 64-byte line


@intrinsic
def select(typingctx, cond, a, b):
    """``a if cond else b`` as one LLVM ``select`` (no branch); ``a``, ``b`` of one type."""
    if not isinstance(cond, types.Boolean) or a != b:
        return None
    def codegen(context, builder, signature, args):
        return builder.select(*args)
    return a(cond, a, b), codegen


_EXP_MASK = np.uint32(0x7F800000)
_SIGN_MASK = np.uint32(0x80000000)


@njit(**OPTS)
def mad(unfused, a, b, c):
    """``a*b + c`` with one rounding (:func:`fma32`), or with two where ``unfused`` (a compile-time constant)."""
    if unfused:
        return a * b + c
    return fma32(a, b, c)


@njit(**OPTS)
def ftz(x):
    """Denormal -> signed zero, branch-free (XLA:CPU's FTZ/DAZ, emulated per operation)."""
    u = _bits_f32(x)
    return select((u & _EXP_MASK) == np.uint32(0), _f32_bits(u & _SIGN_MASK), x)


@njit(**OPTS)
def mad_xla(unfused, a, b, c):
    """XLA:CPU's ``a*b + c``: :func:`fma32`, or where ``unfused`` ``RN(RN(a*b) + c)``, the product flushed."""
    if unfused:
        return ftz(a * b) + c
    return fma32(a, b, c)


@njit(**OPTS)
def max_nan(a, b):
    """``torch.maximum`` (``Vectorized::maximum``): NaN if either is NaN, else the larger."""
    return select((a != a) | (b != b), a + b, select(a < b, b, a))


def _make_prefetch(write: int):
    @intrinsic
    def prefetch(typingctx, arr, idx):
        """Hint: bring the cache line of ``arr[idx]`` in (``llvm.prefetch``); never faults."""
        if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
            return None
        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            # (address, rw: 0 read / 1 write, locality 3: keep in all levels, 1: data)
            builder.call(fn, [ptr, ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.none(arr, idx), codegen
    return prefetch


prefetch_r = _make_prefetch(0)
prefetch_w = _make_prefetch(1)


# -- half-precision conversions (on bit patterns, branch-free) ------------------------------
_U16 = np.uint32(16)


@njit(**OPTS)
def bf16_to_f32(h):
    """bfloat16 bits -> float32 (exact)."""
    return _f32_bits(np.uint32(h) << _U16)


@njit(**OPTS)
def f32_to_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16)."""
    u = _bits_f32(x)
    r = np.uint32(np.uint32(u + (((u >> _U16) & np.uint32(1)) + np.uint32(0x7FFF))) >> _U16)
    return np.uint16(select(x != x, np.uint32(0x7FC0), r))


@njit(**OPTS)
def f16_to_f32(h):
    """IEEE half bits -> float32 (exact), as c10::detail::fp16_ieee_to_fp32_value."""
    w = np.uint32(h) << _U16
    sign = w & np.uint32(0x80000000)
    two_w = np.uint32(w + w)  # Numba widens integer arithmetic: wrap to 32 bits
    exp_scale = np.float32(1.925929944387236e-34)  # 2**-112
    normalized = _f32_bits(np.uint32((two_w >> np.uint32(4)) + np.uint32(0xE0 << 23))) * exp_scale
    denormalized = _f32_bits((two_w >> np.uint32(17)) | np.uint32(126 << 23)) - np.float32(0.5)
    r = select(two_w < np.uint32(1 << 27), _bits_f32(denormalized), _bits_f32(normalized))
    return _f32_bits(np.uint32(sign | r))


@njit(**OPTS)
def f32_to_f16(x):
    """float32 -> IEEE half bits, round to nearest even (c10::detail::fp16_ieee_from_fp32_value)."""
    base = (abs(x) * np.float32(5.192296858534828e33)) * np.float32(7.703719777548943e-34)  # 2**112, 2**-110
    w = _bits_f32(x)
    shl1_w = np.uint32(w + w)  # wrap to 32 bits
    sign = w & np.uint32(0x80000000)
    bias = np.uint32(shl1_w & np.uint32(0xFF000000))
    bias = select(bias < np.uint32(0x71000000), np.uint32(0x71000000), bias)
    base = _f32_bits(np.uint32((bias >> np.uint32(1)) + np.uint32(0x07800000))) + base
    b = _bits_f32(base)
    exp_bits = (b >> np.uint32(13)) & np.uint32(0x00007C00)
    mantissa_bits = b & np.uint32(0x00000FFF)
    nonsign = np.uint32(exp_bits + mantissa_bits)
    nonsign = select(shl1_w > np.uint32(0xFF000000), np.uint32(0x7E00), nonsign)
    return np.uint16(np.uint32(sign >> _U16) | nonsign)


@njit(**OPTS)
def load(x, kind):
    """One buffer element as float32; ``kind`` is a compile-time constant (folded by LLVM)."""
    if kind == KIND_F16:
        return f16_to_f32(x)
    if kind == KIND_BF16:
        return bf16_to_f32(x)
    return np.float32(x)


@njit(**OPTS)
def round16(x, kind):
    """float32 -> uint16 bits of ``kind`` (1 fp16, 2 bf16); ``kind`` a compile-time constant."""
    if kind == KIND_F16:
        return f32_to_f16(x)
    return f32_to_bf16(x)


@njit(**OPTS)
def rt(x, kind):
    """``r(x)``: ``x`` rounded to ``kind`` and back to float32 (the identity for float32)."""
    if kind == KIND_F32:
        return x
    return load(round16(x, kind), kind)


@njit(**OPTS)
def round_xla(x, kind):
    """float32 -> uint16 bits of ``kind`` (1 fp16, 2 bf16) as XLA:CPU converts: :func:`round16`, but a NaN keeps its
    sign (and in fp16 the top of its payload): ``sign | 0x7E00 | mantissa >> 13``, ``sign | 0x7FC0``."""
    u = _bits_f32(x)
    sign = np.uint32((u >> _U16) & np.uint32(0x8000))
    if kind == KIND_F16:
        nan = np.uint32(sign | np.uint32(0x7E00) | ((u >> np.uint32(13)) & np.uint32(0x3FF)))
    else:
        nan = np.uint32(sign | np.uint32(0x7FC0))
    return np.uint16(select(x != x, nan, np.uint32(round16(x, kind))))


@njit(**OPTS)
def rx(x, kind):
    """XLA:CPU's rounding of a flushed float32 result to ``kind`` and back: ``load(round_xla(ftz(x)))``."""
    return load(round_xla(ftz(x), kind), kind)


@intrinsic
def rsqrt_estimate(typingctx, x):
    """This CPU's ``1/sqrt`` estimate of float32 ``x`` (SSE's ``rsqrtss``, the vendor's table: what XLA:CPU's
    ``rsqrt`` starts from); x86-64 only (compiled only by the kernels that need it)."""
    if x != types.float32:
        return None
    def codegen(context, builder, signature, args):
        v4 = ir.VectorType(ir.FloatType(), 4)
        fn = builder.module.declare_intrinsic("llvm.x86.sse.rsqrt.ss", fnty=ir.FunctionType(v4, [v4]))
        lane = ir.Constant(ir.IntType(32), 0)
        vec = builder.insert_element(ir.Constant(v4, [ir.Constant(ir.FloatType(), 0.0)] * 4), args[0], lane)
        return builder.extract_element(builder.call(fn, [vec]), lane)
    return types.float32(x), codegen


__all__ = ["KIND_F32", "KIND_F16", "KIND_BF16", "KINDS", "OPTS", "STRIP", "AHEAD", "LINE", "select", "mad", "ftz",
           "mad_xla", "max_nan", "prefetch_r", "prefetch_w", "bf16_to_f32", "f32_to_bf16", "f16_to_f32", "f32_to_f16",
           "load", "round16", "rt", "round_xla", "rx", "rsqrt_estimate", "fma32"]
