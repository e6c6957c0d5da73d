"""``Tensor.sqrt()`` of torch on the CPU, reproduced bit for bit (Numba, scalar).

torch's CPU ``sqrt`` of float32 is not IEEE ``sqrt``: ATen calls MKL's ``vsSqrt`` in its
high-accuracy mode, which refines a hardware reciprocal-square-root estimate and is
off by one ULP for about 17-20% of inputs. MKL picks the code path from the CPU, and
the estimate instruction itself differs between CPU vendors, so the bits differ from
machine to machine. The paths, read from MKL's machine code (x: positive normal float32,
every operation rounded to float32):

``MKL_SSE`` (``sSqrt_EX``; seen on AMD EPYC)::

    r0 = rsqrtps(x); h = x*r0; r = r0*0.5; e = 0.5 - h*r
    h1 = h*e + h; r1 = r*e + r; d = x - h1*h1; y = d*r1 + h1      # no FMA anywhere

``MKL_FMA14`` (``sSqrt_Z0``, AVX-512) and ``MKL_FMA12`` (``sSqrt_L9``, AVX2)::

    r0 = rsqrt14ps(x) | rsqrtps(x); s = r0*x; hr = r0*0.5
    y = fma(fma(-s, s, x), hr, s)

Special inputs (x <= 0, subnormal, Inf, NaN, x >= 2^128 - 2^116) take MKL's rare path:
``+0/-0 -> x``, negative -> ``+NaN`` (0x7FC00000), ``+Inf``/NaN -> ``x + x``, and
subnormals/huge values the correctly rounded root; ``IEEE`` is the correctly rounded
root everywhere. ``MKL_FMA14`` rescales inputs below 2^-80 on a path not reproduced
here (the correctly rounded root is used: such ``exp_avg_sq`` values are below 1e-24).

The estimates are this machine's own instructions (``rsqrtps`` is not specified exactly
and differs between vendors, ``vrsqrt14ps`` is), so a mode reproduces MKL on the machine
that runs it. Which mode torch uses here is found by probing (:func:`detect_mode`).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

IEEE = 0
MKL_SSE = 1
MKL_FMA14 = 2
MKL_FMA12 = 3
MODE_NAMES = {IEEE: "ieee", MKL_SSE: "mkl_sse", MKL_FMA14: "mkl_fma14", MKL_FMA12: "mkl_fma12"}

_OPTS = dict(nogil=True, cache=True, error_model="numpy")


def _lane0(builder, fn, x, width, extra=()):
    f32 = ir.FloatType()
    vec = ir.Constant(ir.VectorType(f32, width), [ir.Constant(f32, 1.0)] * width)
    vec = builder.insert_element(vec, x, ir.Constant(ir.IntType(32), 0))
    r = builder.call(fn, [vec, *[e(vec) for e in extra]])
    return builder.extract_element(r, ir.Constant(ir.IntType(32), 0))


@intrinsic
def rsqrtps(typingctx, x):
    """This CPU's ``rsqrtps`` estimate of ``1/sqrt(x)`` (lane 0)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        v4 = ir.VectorType(ir.FloatType(), 4)
        fn = builder.module.declare_intrinsic("llvm.x86.sse.rsqrt.ps", fnty=ir.FunctionType(v4, [v4]))
        return _lane0(builder, fn, args[0], 4)

    return types.float32(types.float32), codegen


@intrinsic
def rsqrt14ps(typingctx, x):
    """AVX-512 ``vrsqrt14ps`` (exactly specified; only call on AVX-512 machines)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        f32, i16 = ir.FloatType(), ir.IntType(16)
        v16 = ir.VectorType(f32, 16)
        fn = builder.module.declare_intrinsic(
            "llvm.x86.avx512.rsqrt14.ps.512", fnty=ir.FunctionType(v16, [v16, v16, i16])
        )
        return _lane0(builder, fn, args[0], 16, (lambda v: v, lambda v: ir.Constant(i16, 0xFFFF)))

    return types.float32(types.float32), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _bits(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _from_bits(typingctx, u):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(inline="always", **_OPTS)
def torch_cpu_sqrt(x, mode):
    """``sqrt(x)`` as torch computes it on this CPU in ``mode`` (a compile-time constant)."""
    if mode == IEEE:
        return np.float32(math.sqrt(x))
    b = _bits(x)
    u = np.uint32((np.uint64(b) + np.uint64(0x7F800000)) & np.uint64(0xFFFFFFFF))
    if u < np.uint32(0x80000000) or u > np.uint32(0xFEFFF000):  # MKL's rare path
        if (b & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
            if (b & np.uint32(0x807FFFFF)) == np.uint32(0x80000000):  # -Inf
                return _from_bits(np.uint32(0x7FC00000))
            return x + x  # +Inf, NaN
        if x == np.float32(0.0):
            return x
        if (b >> np.uint32(31)) == np.uint32(1):  # negative
            return _from_bits(np.uint32(0x7FC00000))
        return np.float32(math.sqrt(np.float64(x)))  # subnormal or huge: correctly rounded
    half = np.float32(0.5)
    if mode == MKL_SSE:
        r0 = rsqrtps(x)
        h = x * r0
        r = r0 * half
        e = half - h * r
        h1 = h * e + h
        r1 = r * e + r
        d = x - h1 * h1
        return d * r1 + h1
    if mode == MKL_FMA14 and x < np.float32(8.271806125530277e-25):  # below 2^-80
        return np.float32(math.sqrt(x))
    r0 = rsqrt14ps(x) if mode == MKL_FMA14 else rsqrtps(x)
    s = r0 * x
    hr = r0 * half
    return _fma(_fma(-s, s, x), hr, s)


@njit(**_OPTS)
def _sqrt_array(x, mode):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = torch_cpu_sqrt(x[i], mode)
    return out


def sqrt_array(x: np.ndarray, mode: int) -> np.ndarray:
    """:func:`torch_cpu_sqrt` over a float32 array."""
    return _sqrt_array(np.ascontiguousarray(x, np.float32), mode)


def probe_values(n: int = 1 << 14, seed: int = 0) -> np.ndarray:
    """Inputs that tell the modes apart: [1, 4) densely, wide exponents, specials."""
    rng = np.random.default_rng(seed)
    dense = rng.uniform(1.0, 4.0, n).astype(np.float32)
    wide = (rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-70, 70, n)).astype(np.float32)
    special = np.array([0.0, -0.0, 1.0, 4.0, np.inf, 1e-30, 1e30, 3.4e38], np.float32)
    return np.concatenate([dense, wide, special])


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def detect_mode(reference_sqrt) -> int | None:
    """The mode whose bits equal ``reference_sqrt`` (a float32 array -> array function).

    Returns None when no mode reproduces it on this machine.
    """
    x = probe_values()
    want = np.asarray(reference_sqrt(x), np.float32).view(np.uint32)
    modes = [IEEE, MKL_SSE, MKL_FMA12] + ([MKL_FMA14] if _has_avx512() else [])
    for mode in modes:
        if np.array_equal(sqrt_array(x, mode).view(np.uint32), want):
            return mode
    return None
