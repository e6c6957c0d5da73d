"""The AdamW arithmetic contract: defined once, here.

Every kernel in TrainStream (the Numba host kernels, the CUDA kernels in ``kernels/``)
implements exactly the per-element arithmetic written in this module and points here
instead of restating it. The NumPy functions at the bottom are the executable form of
this text; the tests hold every kernel to them and hold them to the real references.

Symbols
-------
====================  =====================================================================
``p``                 fp32 master weight (the parameter itself when it is fp32)
``m``, ``v``          ``exp_avg``, ``exp_avg_sq`` (fp32)
``g``                 gradient, upcast to fp32 exactly (fp16/bf16 -> fp32 is exact)
``c``                 clip coefficient (fp32; 1 when not clipping)
``lr``                ``lr`` / ``learning_rate``
``b1``, ``b2``        ``betas`` / ``b1``, ``b2``
``eps``               ``eps``
``wd``                ``weight_decay``
``t``                 the step number after increment (1 on the first update)
``f(x)``              ``x`` rounded to the nearest float32 (a host scalar)
``fma(a, b, c)``      ``a*b + c`` rounded once (the FMA instruction)
====================  =====================================================================

All element operations are float32 with round-to-nearest-even; ``a*b + c`` written
without ``fma`` is two roundings and must not be contracted (no fast-math, and CUDA
code uses ``__fmul_rn``/``__fadd_rn`` where the reference does not fuse).

Per-step scalars are computed once on the host, in float64 (Python floats) exactly as
the reference computes them, then rounded to float32 where the reference rounds them.
They travel to a kernel as a small float32 vector laid out by the ``S_*`` indices below.

Conventions
-----------
``torch`` reproduces ``torch.optim.AdamW`` (default, single-tensor/foreach path, which are
bitwise equal) with ``bc1 = 1 - b1**t``, ``bc2 = 1 - b2**t`` in float64:

* platform ``cpu`` (ATen's AVX2/AVX512 kernels; measured on torch 2.13)::

      g  = g * c
      p1 = p * f(1 - lr*wd)                       # param.mul_(1 - lr*wd)
      m  = fma(f(1-b1), g - m, m)                 # exp_avg.lerp_(g, 1-b1), weight < 0.5
         = fma(f(1-b1) - 1, g - m, g)             #   ... weight >= 0.5
      v  = fma(f(1-b2) * g, g, v * f(b2))         # exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
      d  = msqrt(v) / f(sqrt(bc2)) + f(eps)       # true division by the host scalar
      p  = p1 + (f(-lr/bc1) * m) / d              # param.addcdiv_(m, d, -lr/bc1)

  ``msqrt`` is ``Tensor.sqrt()`` on the CPU, which is *not* IEEE ``sqrt``: ATen calls
  MKL's ``vsSqrt``, whose result depends on the CPU (vendor and vector width). The three
  MKL code paths are reproduced exactly in :mod:`trainstream._cpu_sqrt`; which one torch
  runs on a machine is found by probing ``torch.sqrt`` (the torch adapter does it once).
  ATen's scalar ``DEFAULT`` build (no AVX2) does not fuse the lerp/addcmul; that build is
  not targeted (every x86-64 server since 2013 has AVX2+FMA).

* platform ``cuda`` (torch's default on CUDA is the *foreach* path, whose kernels
  nvcc compiles with ``a + b*c`` contracted; measured on torch 2.11, H200)::

      g  = g * c
      p1 = p * f(1 - lr*wd)                       # _foreach_mul_
      m  = fma(f(1-b1), g - m, m)                 # _foreach_lerp_, weight < 0.5
         = fma(f(1-b1) - 1, g - m, g)             #   ... weight >= 0.5
      v  = fma(f(1-b2), g * g, v * f(b2))         # _foreach_mul_, _foreach_addcmul_
      d  = sqrt(v) / f(sqrt(bc2)) + f(eps)        # _foreach_div_ (scalar list): true division
      p  = fma(f(-lr/bc1), m / d, p1)             # _foreach_addcdiv_

  torch's single-tensor path on CUDA (``foreach=False``) differs in one line: its
  ``Tensor / python_scalar`` multiplies by a reciprocal, ``d = sqrt(v) * f(1/sqrt(bc2))
  + f(eps)``; that path is not a convention (it is not the default anywhere).

``optax`` reproduces ``optax.adamw`` as jit-compiled by XLA (``count`` an int32, the bias
corrections computed by XLA in float32: they are *inputs* here, computed by the JAX
adapter with the same jnp expression optax uses, see :func:`optax_bias_corrections`)::

      g  = g * c                                   # see OPTAX_CLIP below
      m  = f(1-b1) * g + f(b1) * m                 # two roundings each, no FMA
      v  = f(1-b2) * (g * g) + f(b2) * v
      u  = m / (bc1 * (sqrt(v / bc2) + f(eps)))    # XLA folds (m/bc1)/(...) into one divide
      u  = u + f(wd) * p                           # add_decayed_weights
      p  = p + u * f(-lr)                          # scale_by_learning_rate, apply_updates

  On XLA:GPU ``sqrt`` is the approximate ``sqrt.approx.f32`` instruction, which a host
  cannot reproduce bit for bit; the host kernels use the IEEE ``sqrt`` there and the
  tests bound the difference in ULPs (see ``OPTAX_CUDA_MAX_ULP``).

Numerical hazards, named where they occur: ``1 - lr*wd`` and ``-lr/bc1`` are rounded to
float32 once (not per element); ``d`` is never zero for ``eps > 0`` but a gradient of
Inf/NaN propagates to ``m``, ``v`` and ``p`` exactly as in the references (no guard);
``bc2`` underflows for ``b2`` very close to 1 and tiny ``t`` only below float64
precision, far from any practical setting.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import numpy as np

__all__ = [
    "CONVENTIONS",
    "PLATFORMS",
    "AdamWHyperParams",
    "validate_hyperparams",
    "variant_id",
    "torch_step_scalars",
    "optax_step_scalars",
    "step_scalars",
    "clip_coefficient",
    "fma_f32",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "round_to",
    "reference_update",
]

Convention = Literal["torch", "optax"]
Platform = Literal["cpu", "cuda"]
CONVENTIONS: tuple[str, ...] = ("torch", "optax")
PLATFORMS: tuple[str, ...] = ("cpu", "cuda")

# -- kernel variants: (convention, platform) -> small integer ------------------------------
VARIANT_TORCH_CPU = 0
VARIANT_TORCH_CUDA = 1
VARIANT_OPTAX_CPU = 2
VARIANT_OPTAX_CUDA = 3

# -- the per-step scalar vector ------------------------------------------------------------
N_SCALARS = 12
S_CLIP = 0  # c: fp32 gradient multiplier (1.0 when not clipping)
# torch convention
S_DECAY = 1  # f(1 - lr*wd)
S_LERP_W = 2  # f(1 - b1)              lerp weight
S_LERP_SMALL = 3  # 1.0 when f(1-b1) < 0.5, else 0.0 (which lerp formula)
S_BETA2 = 4  # f(b2)
S_OMB2 = 5  # f(1 - b2)
S_BC2 = 6  # f(sqrt(bc2)), a divisor
S_EPS = 7  # f(eps)
S_NEG_STEP = 8  # f(-lr/bc1)
# optax convention (reuses the indices above where the meaning is the same)
S_OMB1 = 2  # f(1 - b1)
S_BETA1 = 3  # f(b1)
# S_BETA2, S_OMB2, S_EPS as above
S_BC1 = 6  # bc1 (float32, as XLA computes it)
S_BC2_OPTAX = 9  # bc2 (float32, as XLA computes it)
S_WD = 1  # f(wd)
S_NEG_LR = 8  # f(-lr)

#: Largest distance per step between the optax/cuda kernel (XLA:GPU's approximate
#: ``sqrt.approx``/``div.full``) and its IEEE host emulation, in float32 ULPs of
#: ``max(|p|, |update|, |p_new|)`` (plain ULPs of ``p_new`` are unbounded where the update
#: cancels the weight). Measured on the H200 (2026-11-30): at most 5 over 29 layouts and
#: dtypes x 10 steps; the bound leaves margin.
OPTAX_CUDA_MAX_ULP = 8


class AdamWHyperParams(NamedTuple):
    """AdamW hyper-parameters of one parameter group (Python floats, float64)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def validate_hyperparams(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> AdamWHyperParams:
    """Check AdamW hyper-parameters and return them as an :class:`AdamWHyperParams`.

    Raises ``ValueError`` with the same wording as ``torch.optim.AdamW``.
    """
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"Invalid learning rate type: {type(lr).__name__} (expected a float)")
    if not 0.0 <= lr or math.isnan(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps or math.isnan(eps):
        raise ValueError(f"Invalid epsilon value: {eps}")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair of floats)") from None
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b1}")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b2}")
    if not 0.0 <= weight_decay or math.isnan(weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    return AdamWHyperParams(float(lr), float(b1), float(b2), float(eps), float(weight_decay))


def variant_id(convention: str, platform: str) -> int:
    """The kernel variant number of a (convention, platform) pair."""
    if convention not in CONVENTIONS:
        raise ValueError(f"Unknown convention {convention!r}; expected one of {CONVENTIONS}")
    if platform not in PLATFORMS:
        raise ValueError(f"Unknown platform {platform!r}; expected one of {PLATFORMS}")
    return CONVENTIONS.index(convention) * 2 + PLATFORMS.index(platform)


def _f32(x: float) -> np.float32:
    return np.float32(x)


def torch_step_scalars(
    hp: AdamWHyperParams, step: int, platform: str, clip: float | np.float32 = 1.0
) -> np.ndarray:
    """Per-step scalars of the ``torch`` convention for update number ``step`` (>= 1).

    Mirrors ``torch/optim/adam.py``: ``bias_correction1 = 1 - beta1 ** step`` etc. in
    Python floats, then each scalar rounded to float32 where ATen casts it.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after increment), got {step}")
    s = np.zeros(N_SCALARS, np.float32)
    lr, b1, b2, eps, wd = hp
    t = float(step)  # torch keeps `step` as a float tensor and calls .item()
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    bc2_sqrt = bc2**0.5
    s[S_CLIP] = np.float32(clip)
    s[S_DECAY] = _f32(1 - lr * wd)
    s[S_LERP_W] = _f32(1 - b1)
    s[S_LERP_SMALL] = 1.0 if abs(float(_f32(1 - b1))) < 0.5 else 0.0
    s[S_BETA2] = _f32(b2)
    s[S_OMB2] = _f32(1 - b2)
    s[S_BC2] = _f32(bc2_sqrt)
    s[S_EPS] = _f32(eps)
    s[S_NEG_STEP] = _f32(-(lr / bc1))
    return s


def optax_bias_corrections(b1: float, b2: float, count, xp=np):
    """``(1 - b1**count, 1 - b2**count)`` in float32, written as optax writes it.

    ``count`` is the int32 step count after increment. The JAX adapter calls this with
    ``xp=jax.numpy`` inside the jitted step so that XLA computes the same bits as optax;
    with NumPy the power may differ from XLA's in the last bit (a reference only).
    """
    count = xp.asarray(count, dtype=xp.int32)
    one = xp.asarray(1, xp.float32)
    bc1 = one - xp.asarray(b1, xp.float32) ** count.astype(xp.float32)
    bc2 = one - xp.asarray(b2, xp.float32) ** count.astype(xp.float32)
    return bc1, bc2


def optax_step_scalars(
    hp: AdamWHyperParams,
    bc1: float | np.float32,
    bc2: float | np.float32,
    clip: float | np.float32 = 1.0,
) -> np.ndarray:
    """Per-step scalars of the ``optax`` convention, given XLA's float32 bias corrections."""
    s = np.zeros(N_SCALARS, np.float32)
    lr, b1, b2, eps, wd = hp
    s[S_CLIP] = np.float32(clip)
    s[S_WD] = _f32(wd)
    s[S_OMB1] = _f32(1 - b1)
    s[S_BETA1] = _f32(b1)
    s[S_BETA2] = _f32(b2)
    s[S_OMB2] = _f32(1 - b2)
    s[S_BC1] = np.float32(bc1)
    s[S_EPS] = _f32(eps)
    s[S_NEG_LR] = _f32(-lr)
    s[S_BC2_OPTAX] = np.float32(bc2)
    return s


def step_scalars(
    hp: AdamWHyperParams,
    step: int,
    convention: str,
    platform: str,
    clip: float | np.float32 = 1.0,
) -> np.ndarray:
    """The float32 scalar vector for ``step`` in ``convention`` on ``platform``.

    For ``optax`` the bias corrections come from :func:`optax_bias_corrections` with
    NumPy; the JAX adapter computes them with XLA instead and calls
    :func:`optax_step_scalars` directly.
    """
    variant_id(convention, platform)
    if convention == "torch":
        return torch_step_scalars(hp, step, platform, clip)
    bc1, bc2 = optax_bias_corrections(hp.beta1, hp.beta2, step)
    return optax_step_scalars(hp, bc1, bc2, clip)


def clip_coefficient(norm: float, max_norm: float) -> np.float32:
    """``min(1, max_norm / (norm + 1e-6))`` in float32, as ``clip_grad_norm_`` computes it.

    ``norm`` is the global L2 norm of all gradients (TrainStream sums float64 partials,
    torch sums float32 norms: the two may differ in the last bits). A non-finite norm
    gives a non-finite coefficient, which poisons the update exactly as torch's does.
    """
    coef = np.float32(max_norm) / (np.float32(norm) + np.float32(1e-6))
    return np.float32(min(np.float32(1.0), coef)) if not np.isnan(coef) else np.float32(coef)


# -- exact float32 helpers for the NumPy reference ------------------------------------------


def fma_f32(a, b, c) -> np.ndarray:
    """``a*b + c`` rounded once to float32 (the FMA instruction), exactly, in NumPy.

    The float32 product is exact in float64; the float64 sum ``s`` is rounded once and
    its rounding error ``e`` recovered exactly (TwoSum). ``f32(s)`` equals the correctly
    rounded result unless ``s`` sits exactly on a float32 tie, which ``e`` then breaks.
    """
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
    """float32 -> bfloat16 bit pattern (uint16), round to nearest even, as c10::BFloat16.

    NaN becomes the quiet NaN 0x7FC0 (sign dropped), Inf stays Inf.
    """
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


def reference_update(
    p: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    scalars: np.ndarray,
    convention: str,
    platform: str,
    sqrt=np.sqrt,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdamW update in NumPy float32: the executable statement of the contract.

    ``p``, ``m``, ``v`` are float32 master weight and moments, ``g`` the fp32 (upcast)
    gradient, ``scalars`` the vector of :func:`step_scalars`. Returns new arrays.
    ``sqrt`` is ``msqrt`` of the torch/cpu convention (default: IEEE; pass the sqrt the
    reference really uses, e.g. torch's, or ``_cpu_sqrt.sqrt_array`` in a detected mode).
    """
    variant = variant_id(convention, platform)
    s = np.asarray(scalars, np.float32)
    p, m, v = (np.asarray(a, np.float32) for a in (p, m, v))
    with np.errstate(all="ignore"):
        g = np.asarray(g, np.float32) * s[S_CLIP]
        if convention == "torch":
            p1 = p * s[S_DECAY]
            if s[S_LERP_SMALL]:
                m = fma_f32(s[S_LERP_W], g - m, m)
            else:
                m = fma_f32(s[S_LERP_W] - np.float32(1), g - m, g)
            if variant == VARIANT_TORCH_CPU:
                v = fma_f32(s[S_OMB2] * g, g, v * s[S_BETA2])
                d = np.asarray(sqrt(v), np.float32) / s[S_BC2] + s[S_EPS]
                p = p1 + (s[S_NEG_STEP] * m) / d
            else:
                v = fma_f32(s[S_OMB2], g * g, v * s[S_BETA2])
                d = np.sqrt(v) / s[S_BC2] + s[S_EPS]
                p = fma_f32(s[S_NEG_STEP], m / d, p1)
        else:
            m = s[S_OMB1] * g + s[S_BETA1] * m
            v = s[S_OMB2] * (g * g) + s[S_BETA2] * v
            u = m / (s[S_BC1] * (np.sqrt(v / s[S_BC2_OPTAX]) + s[S_EPS]))
            u = u + s[S_WD] * p
            p = p + u * s[S_NEG_LR]
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)
