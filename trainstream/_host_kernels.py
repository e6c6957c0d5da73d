"""Numba host kernels: the AdamW update of :mod:`trainstream.contract` (:func:`adamw_chunk`).

Kernels work on flat, contiguous 1-D buffers over a half-open ``[begin, end)`` range (worker threads
run disjoint chunks of one parameter), release the GIL and are cached on disk (a later process
loads each in ~0.01 s instead of compiling it in 3-7 s). Half-precision buffers travel as their
``uint16`` bits with a *kind* code (0 float32, 1 IEEE float16, 2 bfloat16; Numba has no bfloat16):
conversions to float32 are exact; from float32 they round to nearest even and keep Inf and NaN,
bit-identical to ``c10::Half``/``c10::BFloat16`` (NaN becomes the canonical quiet NaN). FMA comes
only from :func:`fma32`, where the contract has it (no fast-math).

So that the loops vectorise, each raw kernel picks a compiled specialisation from a table keyed by
its codes (kinds, variant, mode): a closure whose codes are compile-time constants, so its loop has
no per-element branch (``numba.literally`` re-typed on every call: ~50 ms). Closures follow
:mod:`trainstream._jit`'s cache rules (``_mad(unfused, ...)``, ``torch_cpu_sqrt(x, sqrt_mode)``,
``_DEPS``). Loops run over unsigned indices (a signed one costs a wrap-around select per access),
read scalars into locals first and choose per element by :func:`_select`, never by branch.
``inspect_asm`` of a cached specialisation is empty: tests/test_host_kernels.py compiles uncached
copies to check the machine code.
"""

from __future__ import annotations

import math
import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _cpu_sqrt, _jit, contract
from ._cpu_sqrt import IEEE as SQRT_IEEE
from ._cpu_sqrt import require_mode, torch_cpu_sqrt, torch_cpu_sqrt_block  # msqrt of the contract
from ._jit import OPTS as _JIT_OPTS
from ._jit import bits_f32 as _bits_f32
from ._jit import f32_bits as _f32_bits
from ._jit import fma32, njit, source_stamp
from .contract import (OX_CLIP, OX_CODES, OX_FORM_R, OX_MU_SWAP, OX_NO_FMA, OX_NU_SWAP, S_BC1, S_BC2_OPTAX, S_BETA1,
                       S_BETA2, S_CLIP, S_CLIP_DIV, S_DECAY, S_EPS, S_LERP_SMALL, S_NEG_LR, S_NEG_STEP, S_OMB1, S_OMB2,
                       S_OX_CODE, S_SQRT_BC2, S_WD, TC_CODES, TC_NO_FMA, VARIANT_OPTAX_CPU, VARIANT_OPTAX_CUDA,
                       VARIANT_TORCH_CPU, VARIANT_TORCH_CUDA)

__all__ = ["KIND_F32", "KIND_F16", "KIND_BF16", "OUT_IN_GRAD", "OUT_U", "adamw_chunk", "fma32"]

KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
_KINDS = (KIND_F32, KIND_F16, KIND_BF16)
#: ``okind`` that writes the rounded weights back into the fp16/bf16 gradient buffer (``out16 is g``): a kernel
#: of its own, as overlapping array arguments fail LLVM's run-time alias check (scalar loop, ~6x slower).
OUT_IN_GRAD = 3
#: ``okind`` (optax) that writes the contract's ``u`` (the update before the learning rate) into a float32
#: ``out``, ``p`` unwritten (the JAX adapter's ``update``: its XLA program applies ``-lr`` as optax does).
OUT_U = 4
_VARIANTS = (VARIANT_TORCH_CPU, VARIANT_TORCH_CUDA, VARIANT_OPTAX_CPU, VARIANT_OPTAX_CUDA)
_OPTS = dict(_JIT_OPTS, boundscheck=False)



# -- LLVM intrinsics (fma32 and the bit casts are _jit's) --------------------------------------
@intrinsic
def _select(typingctx, cond, a, b):
    """``a if cond else b`` as one LLVM ``select`` (no branch); ``a``, ``b`` of one type."""
    if not isinstance(cond, types.Boolean) or a != b:
        return None
    def codegen(context, builder, signature, args):
        return builder.select(*args)
    return a(cond, a, b), codegen


_EXP_MASK = np.uint32(0x7F800000)
_SIGN_MASK = np.uint32(0x80000000)


@njit(inline="always", **_OPTS)
def _mad(unfused, a, b, c):
    """``a*b + c`` with one rounding (:func:`fma32`), or with two where ``unfused`` (a compile-time constant)."""
    if unfused:
        return a * b + c
    return fma32(a, b, c)


@njit(inline="always", **_OPTS)
def _ftz(x):
    """Denormal -> signed zero, branch-free (XLA:CPU's FTZ/DAZ, emulated per operation)."""
    u = _bits_f32(x)
    return _select((u & _EXP_MASK) == np.uint32(0), _f32_bits(u & _SIGN_MASK), x)


@njit(inline="always", **_OPTS)
def _mad_xla(unfused, a, b, c):
    """XLA:CPU's ``a*b + c``: :func:`fma32`, or where ``unfused`` ``RN(RN(a*b) + c)``, the product flushed."""
    if unfused:
        return _ftz(a * b) + c
    return fma32(a, b, c)


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


_prefetch_r = _make_prefetch(0)
_prefetch_w = _make_prefetch(1)

# The AdamW loop prefetches, before each strip of _STRIP elements, the lines _AHEAD elements ahead in
# every stream: with 7 streams, hardware prefetch alone leaves a core short of memory-level parallelism
# (+5..10 % at 8 and 16 threads, measured on the 16-core Xeon host of the H200, 2**27 elements).
_STRIP = np.uint64(64)
_AHEAD = np.uint64(512)
_LINE = np.uint64(16)  # float32 elements per 64-byte line


# -- half-precision conversions (on bit patterns, branch-free) ------------------------------
_U16 = np.uint32(16)


@njit(inline="always", **_OPTS)
def bf16_to_f32(h):
    """bfloat16 bits -> float32 (exact)."""
    return _f32_bits(np.uint32(h) << _U16)


@njit(inline="always", **_OPTS)
def f32_to_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16)."""
    u = _bits_f32(x)
    r = np.uint32(np.uint32(u + (((u >> _U16) & np.uint32(1)) + np.uint32(0x7FFF))) >> _U16)
    return np.uint16(_select(x != x, np.uint32(0x7FC0), r))


@njit(inline="always", **_OPTS)
def f16_to_f32(h):
    """IEEE half bits -> float32 (exact), as c10::detail::fp16_ieee_to_fp32_value."""
    w = np.uint32(h) << _U16
    sign = w & np.uint32(0x80000000)
    two_w = np.uint32(w + w)  # Numba widens integer arithmetic: wrap to 32 bits
    exp_scale = np.float32(1.925929944387236e-34)  # 2**-112
    normalized = _f32_bits(np.uint32((two_w >> np.uint32(4)) + np.uint32(0xE0 << 23))) * exp_scale
    denormalized = _f32_bits((two_w >> np.uint32(17)) | np.uint32(126 << 23)) - np.float32(0.5)
    r = _select(two_w < np.uint32(1 << 27), _bits_f32(denormalized), _bits_f32(normalized))
    return _f32_bits(np.uint32(sign | r))


@njit(inline="always", **_OPTS)
def f32_to_f16(x):
    """float32 -> IEEE half bits, round to nearest even (c10::detail::fp16_ieee_from_fp32_value)."""
    base = (abs(x) * np.float32(5.192296858534828e33)) * np.float32(7.703719777548943e-34)  # 2**112, 2**-110
    w = _bits_f32(x)
    shl1_w = np.uint32(w + w)  # wrap to 32 bits
    sign = w & np.uint32(0x80000000)
    bias = np.uint32(shl1_w & np.uint32(0xFF000000))
    bias = _select(bias < np.uint32(0x71000000), np.uint32(0x71000000), bias)
    base = _f32_bits(np.uint32((bias >> np.uint32(1)) + np.uint32(0x07800000))) + base
    b = _bits_f32(base)
    exp_bits = (b >> np.uint32(13)) & np.uint32(0x00007C00)
    mantissa_bits = b & np.uint32(0x00000FFF)
    nonsign = np.uint32(exp_bits + mantissa_bits)
    nonsign = _select(shl1_w > np.uint32(0xFF000000), np.uint32(0x7E00), nonsign)
    return np.uint16(np.uint32(sign >> _U16) | nonsign)


@njit(inline="always", **_OPTS)
def _load(x, kind):
    """One buffer element as float32; ``kind`` is a compile-time constant (folded by LLVM)."""
    if kind == KIND_F16:
        return f16_to_f32(x)
    if kind == KIND_BF16:
        return bf16_to_f32(x)
    return np.float32(x)


@njit(inline="always", **_OPTS)
def _round16(x, kind):
    """float32 -> uint16 bits of ``kind`` (1 fp16, 2 bf16); ``kind`` a compile-time constant."""
    if kind == KIND_F16:
        return f32_to_f16(x)
    return f32_to_bf16(x)


# -- specialisation factories (module docstring); ``cache=False``: an uncached copy (machine code)

#: The source stamp of the modules whose globals the kernels use (:func:`trainstream._jit.source_stamp`; the
#: contract's constants are defined in its ``_scalars``).
_DEPS = source_stamp(_jit, _cpu_sqrt, contract, contract._scalars)


def _build_adamw(variant: int, gkind: int, okind: int, mode: int = SQRT_IEEE, cache: bool = True):
    """``mode``: the torch/cpu code (sqrt mode | TC_NO_FMA), the optax/cpu code, else 0."""
    torch_conv = variant == VARIANT_TORCH_CPU or variant == VARIANT_TORCH_CUDA
    cpu = variant == VARIANT_TORCH_CPU
    optax_cpu = variant == VARIANT_OPTAX_CPU
    sqrt_mode = (mode & ~TC_NO_FMA) if cpu else SQRT_IEEE
    require_mode(sqrt_mode)  # only this mode's instructions reach LLVM
    unfused = cpu and (mode & TC_NO_FMA) != 0  # ATen's DEFAULT kernels: lerp and addcmul as two roundings
    ox = mode if optax_cpu else 0  # ox_unfused: XLA:CPU without FMA3, every contracted line two roundings, each flushed
    ox_unfused, ox_form_r, ox_clip, ox_mu_swap, ox_nu_swap = (
        (ox & b) != 0 for b in (OX_NO_FMA, OX_FORM_R, OX_CLIP, OX_MU_SWAP, OX_NU_SWAP))
    in_grad = okind == OUT_IN_GRAD  # the rounded weights overwrite g[i] (read just before)
    emit_u = okind == OUT_U  # optax: u into out (float32), p read only
    write16 = okind == KIND_F16 or okind == KIND_BF16
    rkind = gkind if in_grad else okind  # the format the weights are rounded to
    blocked = cpu and sqrt_mode != SQRT_IEEE  # MKL's root, taken 16 lanes at a time
    strip = int(_STRIP)
    grad16 = torch_conv and gkind != KIND_F32  # torch: g * c rounded to the gradient's format
    deps = _DEPS

    @njit(key=(variant, gkind, okind, mode), **dict(_OPTS, cache=cache))
    def adamw_kernel(p, m, v, g, out16, begin, end, s):
        deps  # noqa: B018 (in the closure: the cache key)
        # every scalar into a local (slots a convention does not use too: the vector has N_SCALARS)
        c, div = s[S_CLIP], s[S_CLIP_DIV]
        round_g = grad16 and c != np.float32(1.0)  # g * 1 is exact: nothing to round
        omb1, b2, omb2, eps = s[S_OMB1], s[S_BETA2], s[S_OMB2], s[S_EPS]  # both conventions
        # torch; lerp(m, g, w): fma(w, g - m, m) for w < 0.5, else fma(w - 1, g - m, g)
        decay, sqrt_bc2, neg_step = s[S_DECAY], s[S_SQRT_BC2], s[S_NEG_STEP]
        small = s[S_LERP_SMALL] != np.float32(0.0)
        w = omb1 if small else omb1 - np.float32(1.0)
        # optax (cpu and cuda: the host uses the IEEE sqrt, see the contract)
        b1, bc1, bc2, wd, neg_lr = s[S_BETA1], s[S_BC1], s[S_BC2_OPTAX], s[S_WD], s[S_NEG_LR]
        # optax/cpu: every scalar read with DAZ, as XLA:CPU reads it
        z_c, z_div = _ftz(c), _ftz(div)
        z_b1, z_omb1, z_b2, z_omb2 = _ftz(b1), _ftz(omb1), _ftz(b2), _ftz(omb2)
        z_d1, z_d2, z_eps, z_wd, z_neg_lr = _ftz(bc1), _ftz(bc2), _ftz(eps), _ftz(wd), _ftz(neg_lr)
        z_r1, z_r2 = _ftz(np.float32(1.0) / z_d1), _ftz(np.float32(1.0) / z_d2)  # form R: XLA's divide(1, 1 - b**t)
        decays = z_wd != np.float32(0.0)
        # optax/cuda with optax.clip_by_global_norm: g = (g / norm) * max_norm
        cuda_clip = (np.int64(s[S_OX_CODE]) & OX_CLIP) != 0
        root = np.empty(strip, np.float32)  # the strip's square roots (blocked only)
        stop = np.uint64(end)
        lo = np.uint64(begin)
        while lo < stop:  # strips of _STRIP elements, prefetching _AHEAD elements ahead
            hi = min(lo + _STRIP, stop)
            for q in range(np.uint64(0), _STRIP, _LINE):
                j = lo + _AHEAD + q
                _prefetch_w(p, j)
                _prefetch_w(m, j)
                _prefetch_w(v, j)
                if in_grad:
                    _prefetch_w(g, j)
                else:
                    _prefetch_r(g, j)
                if write16 or emit_u:
                    _prefetch_w(out16, j)
            if blocked:
                # torch/cpu with MKL's root: the same lines in three passes, the root 16 lanes at a time
                for i in range(lo, hi):
                    gi = _load(g[i], gkind) * c  # g = g * c
                    if round_g:
                        gi = _load(_round16(gi, gkind), gkind)
                    mi = m[i]
                    m[i] = _mad(unfused, w, gi - mi, _select(small, mi, gi))  # lerp
                    v[i] = _mad(unfused, omb2 * gi, gi, v[i] * b2)  # addcmul on the CPU
                torch_cpu_sqrt_block(v, np.int64(lo), np.int64(hi - lo), root, sqrt_mode)
                for i in range(lo, hi):
                    d = root[i - lo] / sqrt_bc2 + eps
                    pi = p[i] * decay + (neg_step * m[i]) / d  # p1 + addcdiv on the CPU
                    p[i] = pi
                    if write16:
                        out16[i] = _round16(pi, okind)
                    elif in_grad:
                        g[i] = _round16(pi, rkind)
                lo = hi
                continue
            for i in range(lo, hi):
                if torch_conv:
                    gi = _load(g[i], gkind) * c  # g = g * c
                    if round_g:
                        gi = _load(_round16(gi, gkind), gkind)
                    mi = m[i]
                    pi = p[i] * decay  # p1 = p * f(1 - lr*wd)
                    mi = _mad(unfused, w, gi - mi, _select(small, mi, gi))  # lerp (fma32 on CUDA)
                    if cpu:  # (IEEE root: MKL's take the blocked path)
                        vi = _mad(unfused, omb2 * gi, gi, v[i] * b2)  # addcmul on the CPU
                        d = torch_cpu_sqrt(vi, sqrt_mode) / sqrt_bc2 + eps
                        pi = pi + (neg_step * mi) / d  # addcdiv on the CPU
                    else:
                        vi = fma32(omb2, gi * gi, v[i] * b2)  # addcmul on CUDA
                        d = np.float32(math.sqrt(vi)) / sqrt_bc2 + eps
                        pi = fma32(neg_step, mi / d, pi)  # addcdiv on CUDA
                    u = pi  # (no OUT_U specialisation of the torch convention)
                elif optax_cpu:  # XLA:CPU: FTZ/DAZ on every operation, FMA where LLVM fused
                    gi = _ftz(_load(g[i], gkind))
                    gi = _ftz(_ftz(gi / z_div) * z_c) if ox_clip else _ftz(gi * z_c)
                    pi = _ftz(p[i])
                    mo = _ftz(m[i])
                    vo = _ftz(v[i])
                    if ox_mu_swap:
                        mi = _ftz(_mad_xla(ox_unfused, z_b1, mo, _ftz(z_omb1 * gi)))
                    else:
                        mi = _ftz(_mad_xla(ox_unfused, z_omb1, gi, _ftz(z_b1 * mo)))
                    gg = _ftz(gi * gi)
                    if ox_nu_swap:
                        vi = _ftz(_mad_xla(ox_unfused, z_b2, vo, _ftz(z_omb2 * gg)))
                    else:
                        vi = _ftz(_mad_xla(ox_unfused, z_omb2, gg, _ftz(z_b2 * vo)))
                    if ox_form_r:
                        den = _ftz(np.float32(math.sqrt(_ftz(vi * z_r2))) + z_eps)
                        q = _ftz(_ftz(mi * z_r1) / den)
                    else:
                        den = _ftz(np.float32(math.sqrt(_ftz(vi / z_d2))) + z_eps)
                        q = _ftz(mi / _ftz(z_d1 * den))
                    u = _select(decays, _ftz(_mad_xla(ox_unfused, z_wd, pi, q)), q)
                    pi = _ftz(_mad_xla(ox_unfused, z_neg_lr, u, pi))
                else:  # optax/cuda (host emulation with IEEE sqrt and division)
                    graw = _load(g[i], gkind)
                    gi = _select(cuda_clip, (graw / div) * c, graw * c)
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
                    out16[i] = _round16(pi, okind)
                elif in_grad:
                    g[i] = _round16(pi, rkind)
            lo = hi
    return adamw_kernel


_BUILDERS = {"adamw": _build_adamw}
_VALID_KEYS = {
    "adamw": {(vr, gk, ok, md) for vr in _VARIANTS for gk in _KINDS
              for ok in (_KINDS if gk == KIND_F32 else _KINDS + (OUT_IN_GRAD,))
              + ((OUT_U,) if vr in (VARIANT_OPTAX_CPU, VARIANT_OPTAX_CUDA) else ())
              for md in (TC_CODES if vr == VARIANT_TORCH_CPU
                         else OX_CODES if vr == VARIANT_OPTAX_CPU else (SQRT_IEEE,))},
}
_TABLE: dict = {}
_TABLE_LOCK = threading.Lock()


def _specialisation(kernel: str, key: tuple):
    """The compiled specialisation of ``kernel`` for ``key`` (built on first use)."""
    if (kernel, key) not in _TABLE:
        if key not in _VALID_KEYS[kernel]:
            raise ValueError(f"{kernel}: no specialisation for codes {key}")
        with _TABLE_LOCK:
            if (kernel, key) not in _TABLE:
                _TABLE[kernel, key] = _BUILDERS[kernel](*key)
    return _TABLE[kernel, key]


_NO_OUT = np.empty(0, np.uint16)  # stands in for out16=None (never touched)


# -- the raw kernels (the engine calls these; no validation beyond the codes) ----------------
def adamw_chunk(variant, p, m, v, g, gkind, out16, okind, begin, end, s, tc_code=SQRT_IEEE):
    """One AdamW update of elements ``[begin, end)`` (:mod:`trainstream.contract`).

    ``p`` fp32 master and ``m``/``v`` fp32 moments, updated in place; ``g`` the gradient (float32 for
    ``gkind`` 0, uint16 bits for 1 fp16 / 2 bf16); ``out16`` (uint16, or None) receives the new weights
    rounded to ``okind`` (1 fp16, 2 bf16; 0 nothing), and may be ``g`` itself (``okind == gkind``: each
    gradient is read before its weight overwrites it). ``okind`` :data:`OUT_U` (optax only): ``out16``, a
    float32 array, receives ``u``; ``p`` is only read. ``s``: :func:`~trainstream.contract.step_scalars`'
    vector (optax/cpu's code in ``s[S_OX_CODE]``); ``tc_code``: the contract's torch/cpu code. Unchecked:
    buffers must be C-contiguous, long enough, and disjoint but for ``out16 is g`` (the callers check).
    """
    if okind == OUT_U:
        if out16 is None or out16.dtype != np.float32:
            raise ValueError("adamw_chunk: okind OUT_U writes u into a float32 out")
    elif out16 is None:
        okind, out16 = KIND_F32, _NO_OUT
    elif out16 is g and okind != KIND_F32:
        if okind != gkind:
            raise ValueError(f"adamw_chunk: weights written into the gradient buffer must keep its kind ({gkind}), "
                             f"got {okind}")
        okind, out16 = OUT_IN_GRAD, _NO_OUT
    mode = int(s[S_OX_CODE]) if variant == VARIANT_OPTAX_CPU else tc_code if variant == VARIANT_TORCH_CPU else SQRT_IEEE
    key = (variant, gkind, okind, mode)
    fn = _TABLE.get(("adamw", key)) or _specialisation("adamw", key)
    fn(p, m, v, g, out16, begin, end, s)


