"""``Tensor.sqrt()`` of torch on the CPU (``msqrt`` of :mod:`trainstream.contract`), bit for bit.

ATen calls MKL's ``vsSqrt`` in its high-accuracy mode, which refines a hardware
reciprocal-square-root estimate and is off by one ULP for about 17-20% of inputs. The
paths, read from MKL's machine code (x: positive normal float32, every operation rounded):

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

The estimates are this machine's own instructions (``rsqrtps`` differs between vendors,
``vrsqrt14ps`` is specified exactly), so a mode reproduces MKL on the machine that runs it;
:func:`detect_mode` finds torch's by probing. Numba code calls :func:`torch_cpu_sqrt` and
:func:`torch_cpu_sqrt_block` with the mode a compile-time constant (only that mode's code is
typed), where Numba's target has its instructions (:func:`available_modes`; aarch64: ``IEEE``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from . import _jit
from ._jit import OPTS as _OPTS
from ._jit import njit, source_stamp, target_features
from .contract import fma_f32

IEEE = 0
MKL_SSE = 1
MKL_FMA14 = 2
MKL_FMA12 = 3
MODE_NAMES = {IEEE: "ieee", MKL_SSE: "mkl_sse", MKL_FMA14: "mkl_fma14", MKL_FMA12: "mkl_fma12"}

#: The ISA feature each mode's instructions need (``rsqrtps``: SSE, baseline on x86-64; ``vrsqrt14ps``: AVX-512F).
_NEEDS = {IEEE: None, MKL_SSE: "x86", MKL_FMA12: "x86", MKL_FMA14: "avx512f"}


def available_modes() -> tuple[int, ...]:
    """The modes whose instructions Numba's compile target has (IEEE everywhere)."""
    have = target_features()
    return tuple(m for m, need in _NEEDS.items() if need is None or need in have)


def require_mode(mode: int) -> None:
    """``ValueError`` unless ``mode`` is one of :func:`available_modes`."""
    if mode not in _NEEDS:
        raise ValueError(f"unknown sqrt mode {mode!r}; expected one of {sorted(MODE_NAMES)}")
    if mode not in available_modes():
        raise ValueError(f"sqrt mode {MODE_NAMES[mode]!r} needs the {_NEEDS[mode]!r} instructions, which "
                         f"Numba's target lacks here (it has {sorted(target_features())})")


def _vec_const(ty, width, value):
    return ir.Constant(ir.VectorType(ty, width), [ir.Constant(ty, value)] * width)


def _lanes(idx) -> ir.Constant:  # a shuffle mask
    return ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), list(idx))


def _estimate(builder, x, mode: int):
    """IR: this CPU's ``1/sqrt`` estimate per lane of ``x`` (4 or 16 float lanes): the 16-lane AVX-512
    ``vrsqrt14ps`` (``MKL_FMA14``), else the 4-lane ``rsqrtps`` per quarter."""
    vf, i16 = x.type, ir.IntType(16)
    if mode == MKL_FMA14:
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.rsqrt14.ps.512", fnty=ir.FunctionType(vf, [vf, vf, i16]))
        return builder.call(fn, [x, x, ir.Constant(i16, 0xFFFF)])
    v4 = ir.VectorType(ir.FloatType(), 4)
    fn = builder.module.declare_intrinsic("llvm.x86.sse.rsqrt.ps", fnty=ir.FunctionType(v4, [v4]))
    parts = [builder.call(fn, [builder.shuffle_vector(x, x, _lanes(range(q, q + 4)))]) for q in range(0, vf.count, 4)]
    while len(parts) > 1:  # concatenated pairwise: 4 -> 8 -> 16 lanes
        parts = [builder.shuffle_vector(a, b, _lanes(range(2 * a.type.count))) for a, b in zip(parts[::2], parts[1::2])]
    return parts[0]


def _mkl_vector(builder, x, mode: int):
    """IR: the root of MKL ``mode`` (module docstring) on each lane of ``x`` (``<4 x float>``
    or ``<16 x float>``); the rare path and the tiny inputs by ``select``, no branch."""
    width = x.type.count
    f32, i32 = ir.FloatType(), ir.IntType(32)
    vf, vi = x.type, ir.VectorType(i32, width)
    cf, ci = functools.partial(_vec_const, f32, width), functools.partial(_vec_const, i32, width)
    module = builder.module
    half = cf(0.5)
    vname = f"v{width}f32"
    ieee = builder.call(module.declare_intrinsic(f"llvm.sqrt.{vname}", fnty=ir.FunctionType(vf, [vf])), [x])
    r0 = _estimate(builder, x, mode)
    if mode == MKL_SSE:
        h = builder.fmul(x, r0)
        r = builder.fmul(r0, half)
        e = builder.fsub(half, builder.fmul(h, r))
        h1 = builder.fadd(builder.fmul(h, e), h)
        r1 = builder.fadd(builder.fmul(r, e), r)
        d = builder.fsub(x, builder.fmul(h1, h1))
        y = builder.fadd(builder.fmul(d, r1), h1)
    else:
        fma = module.declare_intrinsic(f"llvm.fma.{vname}", fnty=ir.FunctionType(vf, [vf, vf, vf]))
        s = builder.fmul(r0, x)
        hr = builder.fmul(r0, half)
        inner = builder.call(fma, [builder.fneg(s), s, x])
        y = builder.call(fma, [inner, hr, s])
        if mode == MKL_FMA14:  # below 2^-80: the correctly rounded root
            y = builder.select(builder.fcmp_ordered("<", x, cf(8.271806125530277e-25)), ieee, y)
    # MKL's rare path: x <= 0, subnormal, Inf, NaN, huge (bits + 0x7F800000 outside [2^31, 0xFEFFF000])
    b = builder.bitcast(x, vi)
    u = builder.add(b, ci(0x7F800000))
    rare = builder.or_(builder.icmp_unsigned("<", u, ci(0x80000000)), builder.icmp_unsigned(">", u, ci(0xFEFFF000)))
    nan = builder.bitcast(ci(0x7FC00000), vf)
    allexp = builder.icmp_unsigned("==", builder.and_(b, ci(0x7F800000)), ci(0x7F800000))
    neginf = builder.icmp_unsigned("==", builder.and_(b, ci(0x807FFFFF)), ci(0x80000000))
    iszero = builder.fcmp_ordered("==", x, cf(0.0))
    isneg = builder.icmp_unsigned("!=", builder.lshr(b, ci(31)), ci(0))
    finite_rare = builder.select(iszero, x, builder.select(isneg, nan, ieee))
    rare_val = builder.select(allexp, builder.select(neginf, nan, builder.fadd(x, x)), finite_rare)
    return builder.select(rare, rare_val, y)


@njit(**_OPTS)
def _ieee_sqrt(x):
    return np.float32(math.sqrt(x))


@functools.cache
def scalar_sqrt(mode: int):
    """``x -> sqrt(x)`` of a float32 as torch computes it on this CPU in ``mode``, for Numba code
    (inlined): IEEE's root, or lane 0 of :func:`_mkl_vector` on ``[x, 1, 1, ...]`` (4 lanes;
    16 for ``vrsqrt14ps``). Only that mode's instructions reach LLVM."""
    require_mode(mode)
    if mode == IEEE:
        return _ieee_sqrt
    width = 16 if mode == MKL_FMA14 else 4

    @intrinsic
    def mkl_sqrt(typingctx, x):
        if x != types.float32:
            return None
        def codegen(context, builder, signature, args):
            lane0 = ir.Constant(ir.IntType(32), 0)
            vec = builder.insert_element(_vec_const(ir.FloatType(), width, 1.0), args[0], lane0)
            return builder.extract_element(_mkl_vector(builder, vec, mode), lane0)
        return types.float32(types.float32), codegen
    return mkl_sqrt


def probe_values(n: int = 1 << 14, seed: int = 0) -> np.ndarray:
    """Inputs that tell the modes apart: [1, 4) densely, wide exponents, specials."""
    rng = np.random.default_rng(seed)
    dense = rng.uniform(1.0, 4.0, n).astype(np.float32)
    wide = (rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-70, 70, n)).astype(np.float32)
    special = np.array([0.0, -0.0, 1.0, 4.0, np.inf, 1e-30, 1e30, 3.4e38], np.float32)
    return np.concatenate([dense, wide, special])


def detect_mode(reference_sqrt) -> int | None:
    """The mode (of :func:`available_modes`) whose bits equal ``reference_sqrt`` (a float32
    array -> array function), or None when none reproduces it on this machine."""
    x = probe_values()
    want = np.asarray(reference_sqrt(x), np.float32).view(np.uint32)
    return next((mode for mode in available_modes() if np.array_equal(sqrt_array(x, mode).view(np.uint32), want)),
                None)


def detect_lerp_fma(reference_lerp) -> bool | None:
    """Whether ``reference_lerp(a, b, w) = a.lerp(b, w)`` (float32 arrays, scalar ``w``) is fused (ATen's
    AVX2/AVX-512 kernels: True) or not (its DEFAULT kernels, the contract's ``TC_NO_FMA``: False); else None."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal(1 << 14).astype(np.float32)
    b = rng.standard_normal(1 << 14).astype(np.float32)
    w = np.float32(0.1)
    got = np.asarray(reference_lerp(a, b, 0.1), np.float32).view(np.uint32)
    if np.array_equal(got, fma_f32(w, b - a, a).view(np.uint32)):
        return True
    if np.array_equal(got, (a + w * (b - a)).view(np.uint32)):
        return False
    return None


@functools.cache
def block_sqrt(mode: int):
    """``(src, lo, n, dst) -> dst[k] = sqrt(src[lo + k])`` for ``k < n`` in ``mode``, 16 lanes
    at a time: a loop of :func:`scalar_sqrt` does not vectorise (the MKL modes ran 3-5x slower
    than IEEE). IEEE goes element by element: that loop vectorises by itself."""
    sqrt1 = scalar_sqrt(mode)
    if mode == IEEE:
        @njit(**_OPTS)
        def ieee_block(src, lo, n, dst):
            for k in range(n):
                dst[k] = sqrt1(src[lo + k])
        return ieee_block

    @intrinsic
    def block16(typingctx, src, si, dst, di):
        """``dst[di:di+16] = sqrt1(src[si:si+16])`` (float32 C arrays)."""
        if not (isinstance(src, types.Array) and isinstance(dst, types.Array)):
            return None
        def codegen(context, builder, signature, args):
            vf = ir.VectorType(ir.FloatType(), 16)
            s_arr = context.make_array(signature.args[0])(context, builder, args[0])
            d_arr = context.make_array(signature.args[2])(context, builder, args[2])
            si_v = context.cast(builder, args[1], signature.args[1], types.int64)
            di_v = context.cast(builder, args[3], signature.args[3], types.int64)
            sp = builder.bitcast(builder.gep(s_arr.data, [si_v]), vf.as_pointer())
            dp = builder.bitcast(builder.gep(d_arr.data, [di_v]), vf.as_pointer())
            builder.store(_mkl_vector(builder, builder.load(sp, align=4), mode), dp, align=4)
            return context.get_dummy_value()
        return types.void(src, si, dst, di), codegen

    @njit(**_OPTS)
    def mkl_block(src, lo, n, dst):
        k = 0
        while k + 16 <= n:
            block16(src, lo + k, dst, k)
            k += 16
        while k < n:
            dst[k] = sqrt1(src[lo + k])
            k += 1
    return mkl_block


# -- what Numba code calls: the mode a compile-time constant ----------------------------------
def torch_cpu_sqrt(x, mode):
    """``sqrt(x)`` of a float32 as torch computes it on this CPU in ``mode`` (Numba code
    only, inlined; ``mode`` a compile-time constant, e.g. a closure's int)."""
    raise TypeError("torch_cpu_sqrt is called from Numba code (sqrt_array: the same from Python)")


def torch_cpu_sqrt_block(src, lo, n, dst, mode):
    """``dst[k] = torch_cpu_sqrt(src[lo + k], mode)`` for ``k < n``, 16 lanes at a time (as :func:`torch_cpu_sqrt`)."""
    raise TypeError("torch_cpu_sqrt_block is called from Numba code (_array_kernel(mode, True) from Python)")


def _mode_of(mode) -> int | None:
    """The value of a literal ``mode`` argument type (typing only the mode's own code), else None."""
    if not isinstance(mode, types.IntegerLiteral):
        return None
    require_mode(mode.literal_value)
    return mode.literal_value


@overload(torch_cpu_sqrt, prefer_literal=True)
def _torch_cpu_sqrt(x, mode):
    m = _mode_of(mode)
    if m is None or x != types.float32:
        return None
    sqrt1 = scalar_sqrt(m)
    def impl(x, mode):
        return sqrt1(x)
    return impl


@overload(torch_cpu_sqrt_block, prefer_literal=True)
def _torch_cpu_sqrt_block(src, lo, n, dst, mode):
    m = _mode_of(mode)
    if m is None:
        return None
    sqrt_block = block_sqrt(m)
    def impl(src, lo, n, dst, mode):
        sqrt_block(src, lo, n, dst)
    return impl


_DEPS = source_stamp(_jit)  # in the closures (:mod:`trainstream._jit`)


@functools.cache
def _array_kernel(mode: int, blocked: bool):
    """``x -> sqrt(x)`` over a contiguous float32 array in ``mode``: :func:`torch_cpu_sqrt` element by
    element, or (``blocked``) :func:`torch_cpu_sqrt_block` in strips of 64, as the AdamW kernel takes it."""
    require_mode(mode)
    deps = _DEPS

    @njit(key=(mode, blocked), **_OPTS)
    def sqrt_array_kernel(x):
        deps  # noqa: B018 (in the closure: the cache key)
        out = np.empty_like(x)
        tmp = np.empty(64, np.float32)
        for lo in range(0, x.size, 64):
            m = min(64, x.size - lo)
            if blocked:
                torch_cpu_sqrt_block(x, lo, m, tmp, mode)
                out[lo : lo + m] = tmp[:m]
            else:
                for i in range(lo, lo + m):
                    out[i] = torch_cpu_sqrt(x[i], mode)
        return out
    return sqrt_array_kernel


def sqrt_array(x: np.ndarray, mode: int) -> np.ndarray:
    """:func:`scalar_sqrt` of ``mode`` over a float32 array."""
    return _array_kernel(mode, False)(np.ascontiguousarray(x, np.float32))
