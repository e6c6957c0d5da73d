"""The executable form of :mod:`trainstream.contract`: :func:`reference_update`, the module docstring's lines in
NumPy float32, with the exact float32 helpers it is written with (a single-rounding FMA, bfloat16 rounding, XLA:CPU's
flush-to-zero); the fp32 master's rules (:func:`master_of_weights`, :func:`merge_master`); and, where bit-identity is
impossible, the bounds (``*_MAX_ULP``) and their measure (:func:`update_ulps`). The tests hold every kernel and the
real references to it. Import these names from :mod:`trainstream.contract`."""

from __future__ import annotations

import numpy as np

from ._scalars import (OX_CLIP, S_BC1, S_BC2_OPTAX, S_BETA1, S_BETA2, S_CLIP, S_CLIP_DIV, S_DECAY, S_EPS, S_EPS_ROOT,
                       S_LERP_SMALL, S_NEG_LR, S_NEG_STEP, S_OMB1, S_OMB2, S_OX_CODE, S_SQRT_BC2, S_WD,
                       VARIANT_OPTAX_CPU, VARIANT_TORCH_CPU, variant_id)

# -- where bit-identity is impossible: the bounds, in float32 ULPs --------------------------
#: ``Tensor.sqrt()`` on the CPU (MKL's high-accuracy ``vsSqrt``) against the correctly rounded
#: root, in float32 ULPs, on every path reproduced (measured over :func:`trainstream._cpu_sqrt.probe_values`
#: and [1, 4) exhaustively); where torch's path is not reproducible, ``d`` may differ by that much per step.
TORCH_CPU_SQRT_MAX_ULP = 1

#: Largest distance per step between the optax/cuda kernel (XLA:GPU's ``sqrt.approx``/``div.full``)
#: and its IEEE host emulation, in float32 ULPs of ``max(|p|, |update|, |p_new|)`` (:func:`update_ulps`).
#: Measured on the H200: at most 5 over 29 layouts and dtypes x 10 steps; the bound leaves margin.
OPTAX_CUDA_MAX_ULP = 8

#: The same distance between ``optax.adamw`` jitted on XLA:GPU and the host update of the optax/cuda formula
#: (JAX ``mode="cpu"`` on a GPU: IEEE root and division, also in ``(g / n) * M``), per step from the same state.
#: Measured on the H200 (tests/test_jax_gpu.py, 30 steps x fp32/bf16 x clip/no clip): moments at most 6 ULP,
#: weights 5 without clipping but up to 326 with it where ``m`` nearly cancels (a gradient flipping sign
#: amplifies the moments' last-bit differences; still under a thousandth of the step ``lr * u``): the bound
#: applies to the moments. Each of XLA:GPU's other lines (``_optax_cuda``; H100, 6 steps, tests/test_jax_gpu.py
#: ``test_cpu_mode_each_line_within_the_bound``): float32 nesterov, eps_root, eps == 0 and fp16 state gave the
#: moments' bits (16 ULP with clipping's division), the weights within 4e-4 of the step ``lr``.
OPTAX_CUDA_HOST_MAX_ULP = 16


# -- the fp32 master ------------------------------------------------------------------------
def master_of_weights(master, weights, xp=np):
    """The fp32 master an update of fp16/bf16 ``weights`` starts from: ``master`` where it
    rounds to ``weights``, else the weights upcast (a weight replaced outside the optimizer
    is taken as it is, as a float32 parameter would be). ``xp``: NumPy or ``jax.numpy``."""
    master = xp.asarray(master)
    weights = xp.asarray(weights)
    return xp.where(master.astype(weights.dtype) == weights, master, weights.astype(np.float32))


def merge_master(master: np.ndarray, weights: np.ndarray, dtype: str) -> None:
    """Take weights changed outside the optimizer as its fp32 master, in place: float32
    ``master = weights``; fp16/bf16 (``weights`` upcast): an element whose master still
    rounds to its weight keeps the master, any other takes the weight."""
    weights = np.asarray(weights, np.float32).reshape(-1)
    if dtype == "float32":
        master[:] = weights
        return
    kept = round_to(master, dtype).view(np.uint32) == weights.view(np.uint32)
    np.copyto(master, weights, where=~kept)


# -- exact float32 helpers for the NumPy reference ------------------------------------------
def fma_f32(a, b, c) -> np.ndarray:
    """``a*b + c`` rounded once to float32 (the FMA instruction), exactly, in NumPy: the
    float32 product is exact in float64; the float64 sum ``s`` is rounded once and its error
    ``e`` recovered exactly (TwoSum); ``f32(s)`` is correctly rounded unless ``s`` sits
    exactly on a float32 tie, which ``e`` then breaks."""
    a64 = np.asarray(a, np.float32).astype(np.float64)
    b64 = np.asarray(b, np.float32).astype(np.float64)
    c64 = np.asarray(c, np.float32).astype(np.float64)
    prod = a64 * b64
    with np.errstate(invalid="ignore", over="ignore"):
        s = prod + c64
        bb = s - prod
        e = (prod - (s - bb)) + (c64 - bb)
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        up = np.nextafter(r, np.float32(np.inf))
        down = np.nextafter(r, np.float32(-np.inf))
        tie_up = (e > 0) & (s - r64 == (up.astype(np.float64) - r64) / 2)
        tie_down = (e < 0) & (r64 - s == (r64 - down.astype(np.float64)) / 2)
        r = np.where(tie_up, up, np.where(tie_down, down, r))
        # Inf/NaN inputs: the float64 sum already carries the right special value.
        r = np.where(np.isfinite(s), r, s.astype(np.float32))
    return r.astype(np.float32)


def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even, as c10::BFloat16 (NaN ->
    the quiet NaN 0x7FC0, sign dropped; Inf stays Inf)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(x, np.float32)), np.uint16(0x7FC0), rounded)


def bf16_bits_to_f32(b) -> np.ndarray:
    """bfloat16 bit pattern (uint16) -> float32 (exact)."""
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 weights to ``dtype`` ("float32", "float16", "bfloat16") and back."""
    x = np.asarray(x, np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    raise ValueError(f"Unsupported dtype {dtype!r}")


def reference_update(p: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, scalars: np.ndarray,
                     convention: str, platform: str, sqrt=np.sqrt, fma: bool = True,
                     grad_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdamW update in NumPy float32 (the module docstring's lines); returns new arrays.

    ``g``: the fp32 (upcast) gradient, of format ``grad_dtype`` (torch rounds an fp16/bf16 ``g * c`` to
    it); ``scalars``: :func:`step_scalars`' vector. ``sqrt``: torch/cpu's ``msqrt`` (default IEEE; pass
    torch's, or ``_cpu_sqrt.sqrt_array`` in a detected mode); ``fma=False``: torch/cpu with
    :data:`TC_NO_FMA`. optax/cpu reads its code, :data:`OX_NO_FMA` included, from the scalars.
    """
    variant = variant_id(convention, platform)
    s = np.asarray(scalars, np.float32)
    p, m, v = (np.asarray(a, np.float32) for a in (p, m, v))
    if variant == VARIANT_OPTAX_CPU:  # the float32 lines (an fp16/bf16 leaf's master too)
        from ._optax_reference import optax_reference_update  # noqa: PLC0415 (it builds on this module)
        return optax_reference_update(p, m, v, g, s)[:3]
    with np.errstate(all="ignore"):
        g0 = g
        g = np.asarray(g, np.float32) * s[S_CLIP]
        if convention == "torch":
            g = round_to(g, grad_dtype)
            p1 = p * s[S_DECAY]
            fused = fma or variant != VARIANT_TORCH_CPU
            mad = fma_f32 if fused else (lambda a, b, c: a * b + c)
            m = mad(s[S_OMB1], g - m, m) if s[S_LERP_SMALL] else mad(s[S_OMB1] - np.float32(1), g - m, g)
            if variant == VARIANT_TORCH_CPU:
                v = mad(s[S_OMB2] * g, g, v * s[S_BETA2])
                d = np.asarray(sqrt(v), np.float32) / s[S_SQRT_BC2] + s[S_EPS]
                p = p1 + (s[S_NEG_STEP] * m) / d
            else:
                v = fma_f32(s[S_OMB2], g * g, v * s[S_BETA2])
                d = np.sqrt(v) / s[S_SQRT_BC2] + s[S_EPS]
                p = fma_f32(s[S_NEG_STEP], m / d, p1)
        else:
            if int(s[S_OX_CODE]) & OX_CLIP:  # optax.clip_by_global_norm: (g / norm) * max_norm
                g = (np.asarray(g0, np.float32) / s[S_CLIP_DIV]) * s[S_CLIP]
            m = s[S_OMB1] * g + s[S_BETA1] * m
            v = s[S_OMB2] * (g * g) + s[S_BETA2] * v
            u = m / (s[S_BC1] * (np.sqrt(v / s[S_BC2_OPTAX] + s[S_EPS_ROOT]) + s[S_EPS]))
            u = u + s[S_WD] * p
            p = p + u * s[S_NEG_LR]
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)


# -- optax/cpu: XLA:CPU arithmetic (flush-to-zero, FMA pairings, forms) -----------------------
_F32_TINY = np.float32(2.0**-126)


def ftz(x) -> np.ndarray:
    """Denormals to signed zero (XLA:CPU's FTZ on results, DAZ on operands)."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < _F32_TINY, np.copysign(np.float32(0.0), x), x).astype(np.float32)


def update_ulps(got: np.ndarray, want: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """|got - want| in float32 ULPs of the largest term of ``p_new = p + update`` (``update = want - prev``),
    max(|p|, |update|, |p_new|): plain ULPs of p_new blow up where the update cancels the weight."""
    got, want, prev = (np.asarray(a, np.float32) for a in (got, want, prev))
    with np.errstate(invalid="ignore", over="ignore"):
        upd = np.abs(want.astype(np.float64) - prev.astype(np.float64)).astype(np.float32)
    scale = np.spacing(np.maximum(np.maximum(np.abs(prev), np.abs(want)), upd))
    with np.errstate(invalid="ignore"):
        d = np.abs(got.astype(np.float64) - want.astype(np.float64)) / scale.astype(np.float64)
    same = got.view(np.uint32) == want.view(np.uint32)
    return np.where(same | (np.isnan(got) & np.isnan(want)), 0.0, d)
