"""The AdamW arithmetic contract, defined once.

Every kernel (Numba host kernels, CUDA kernels in ``trainstream/kernels/``) implements the
per-element arithmetic written here. The NumPy functions below are its executable form, which
the tests hold to every kernel and to the real references.

====================  =====================================================================
``p``                 fp32 master weight (the parameter itself when it is fp32)
``m``, ``v``          ``exp_avg``, ``exp_avg_sq`` (fp32)
``g``                 gradient, upcast to fp32 exactly (fp16/bf16 -> fp32 is exact)
``c``                 clip coefficient (fp32; 1 when not clipping)
``lr``                ``lr`` / ``learning_rate``
``b1``, ``b2``        ``betas`` / ``b1``, ``b2``
``eps``, ``wd``       ``eps``, ``weight_decay``
``t``                 the step number after increment (1 on the first update)
``f(x)``              ``x`` rounded to the nearest float32 (a host scalar)
``fma(a, b, c)``      ``a*b + c`` rounded once (the FMA instruction)
====================  =====================================================================

All element operations are float32, round-to-nearest-even; ``a*b + c`` without ``fma`` is
two roundings, never contracted (no fast-math; CUDA code uses ``__fmul_rn``/``__fadd_rn``).
Per-step scalars are computed once on the host in float64 (Python floats) as the reference
computes them, rounded to float32 where it rounds them (optax: but for the inputs only XLA
reproduces), and reach a kernel as a float32 vector indexed by the ``S_*`` constants below.

Conventions
-----------
``torch`` reproduces ``torch.optim.AdamW`` (default single-tensor and foreach paths, bitwise
equal) with ``bc1 = 1 - b1**t``, ``bc2 = 1 - b2**t`` in float64. The gradient, both platforms:
``g = g * c`` in float32, for an fp16/bf16 gradient rounded back, ``g = r(g * c)``; ``c`` stands
for torch's in-place multiplications of ``param.grad`` before ``step()`` (``clip_grad_norm_``'s
by the coefficient cast to the gradient's dtype, ``GradScaler.unscale_``'s by the float32
inverse scale). (The CUDA kernels do not round yet: the torch adapter multiplies ``param.grad``
with torch and gives them ``c = 1``.)

* platform ``cpu`` (ATen's AVX2/AVX512 kernels; measured on torch 2.13)::

      g  = g * c                                  # (fp16/bf16: r(g * c), above)
      p1 = p * f(1 - lr*wd)                       # param.mul_(1 - lr*wd)
      m  = fma(f(1-b1), g - m, m)                 # exp_avg.lerp_(g, 1-b1), weight < 0.5
         = fma(f(1-b1) - 1, g - m, g)             #   ... weight >= 0.5
      v  = fma(f(1-b2) * g, g, v * f(b2))         # exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2)
      d  = msqrt(v) / f(sqrt(bc2)) + f(eps)       # true division by the host scalar
      p  = p1 + (f(-lr/bc1) * m) / d              # param.addcdiv_(m, d, -lr/bc1)

  ATen's ``DEFAULT`` kernels (no AVX2, or ``ATEN_CPU_CAPABILITY=default``; :data:`TC_NO_FMA`)
  do not fuse: the two FMAs are two roundings each (verified on torch 2.13 for ``1-b1`` below,
  at and above 0.5; the other lines are the same at every level)::

      m  = m + f(1-b1) * (g - m)                  # weight < 0.5
         = g + (f(1-b1) - 1) * (g - m)            #   ... weight >= 0.5 (= g - (g-m)*(1-w))
      v  = v * f(b2) + (f(1-b2) * g) * g

  ``msqrt`` is ``Tensor.sqrt()``, *not* IEEE ``sqrt``: MKL's ``vsSqrt``, whose path depends
  on the CPU (vendor, vector width) and on ``MKL_ENABLE_INSTRUCTIONS`` (AMD EPYC kept the SSE
  path at every setting), not on ATen's capability; :mod:`trainstream._cpu_sqrt` reproduces
  the three paths (its modes). The torch/cpu *code*, the mode (bits 0-1) ``| TC_NO_FMA``, is
  probed once from ``torch.sqrt`` and ``Tensor.lerp_`` (:func:`trainstream.backends.torch.torch_cpu_code`).
  Where no mode Numba's target can compile reproduces torch's root (e.g. MKL's AVX-512 path,
  Numba forced below AVX-512), the correctly rounded one is used with a warning
  (:data:`TORCH_CPU_SQRT_MAX_ULP`). aarch64 (read from ATen's ``vml.h`` and ``vec128``, not yet
  run): no MKL; NEON ``vsqrtq_f32`` (correctly rounded), a ``vfmaq_f32`` lerp: probed ``IEEE``, fused.

* platform ``cuda`` (torch's default there is the *foreach* path, whose kernels nvcc
  compiles with ``a + b*c`` contracted; measured on torch 2.11, H200)::

      g  = g * c
      p1 = p * f(1 - lr*wd)                       # _foreach_mul_
      m  = fma(f(1-b1), g - m, m)                 # _foreach_lerp_, weight < 0.5
         = fma(f(1-b1) - 1, g - m, g)             #   ... weight >= 0.5
      v  = fma(f(1-b2), g * g, v * f(b2))         # _foreach_mul_, _foreach_addcmul_
      d  = sqrt(v) / f(sqrt(bc2)) + f(eps)        # _foreach_div_ (scalar list): true division
      p  = fma(f(-lr/bc1), m / d, p1)             # _foreach_addcdiv_

  (``foreach=False`` on CUDA multiplies by a reciprocal, ``d = sqrt(v) * f(1/sqrt(bc2)) +
  f(eps)``: not a convention, it is the default nowhere.)

``optax`` reproduces ``optax.adamw`` (optionally ``optax.chain(optax.clip_by_global_norm(M),
optax.adamw(...))`` and ``mask=``) as ``jax.jit`` compiles it, update and ``apply_updates`` in
one program. The per-step inputs are XLA's: the JAX adapter computes them in the jitted step
with optax's own jnp expressions (:func:`optax_scalar_matrix`) and passes the float32 results:

* ``t = safe_increment(count)`` (int32), ``d1 = 1 - b1**t``, ``d2 = 1 - b2**t`` in float32
  (XLA:CPU calls glibc ``powf``, which is not correctly rounded: a NumPy or float64 power
  differs in the last bit for thousands of ``t``);
* ``lr``: the constant ``f(lr)``, or ``schedule(t - 1)`` evaluated by XLA in float32 (XLA's
  constant folding changes a schedule's arithmetic; only XLA reproduces XLA);
* the global norm ``n`` of ``optax.tree.norm(grads)`` (XLA's reduction order, which on
  XLA:CPU depends on leaf sizes, and for large leaves on the thread count).

platform ``cpu`` (XLA:CPU, jax/jaxlib 0.10.2, optax 0.2.8, x86-64 with FMA3, glibc libm; read
from the optimized HLO and machine code, verified bit for bit). XLA:CPU runs with FTZ and DAZ:
every operand below is read, and every result (``RN``, ``fma``) flushed, with denormals as
signed zeros. LLVM contracts ``a*b + c`` into FMAs; the pairing it picks is part of the contract::

      B1, B2, C1, C2 = f(b1), f(b2), f(1-b1), f(1-b2)   # 1-b in float64, rounded once
      g  = RN(RN(g / s[S_CLIP_DIV]) * s[S_CLIP])            # OX_CLIP: IEEE division, multiply
      g  = RN(g * s[S_CLIP])                                # without OX_CLIP
      m  = fma(C1, g, RN(B1*m))                             # default pairing
      m  = fma(B1, m, RN(C1*g))                             # OX_MU_SWAP
      gg = RN(g*g)
      v  = fma(C2, gg, RN(B2*v))                            # default pairing
      v  = fma(B2, v, RN(C2*gg))                            # OX_NU_SWAP
      q  = RN(m / RN(d1 * RN(sqrt(RN(v/d2)) + f(eps))))     # form D (default)
      q  = RN(RN(m*r1) / RN(sqrt(RN(v*r2)) + f(eps)))       # OX_FORM_R, r = RN(1/d)
      u  = fma(f(wd), p, q)        (u = q when wd == 0 or the leaf is masked out)
      p  = fma(f(-lr), u, p)       # scale_by_learning_rate and apply_updates: one rounding

  The pairing and form depend on the program, not the values: a leaf's *code* (bits :data:`OX_FORM_R`,
  :data:`OX_NU_SWAP`, :data:`OX_MU_SWAP`, :data:`OX_CLIP`) is :func:`optax_cpu_code`'s. Form R: only in a
  pytree of one leaf of more than one element (XLA's ``A / broadcast(B) -> A * (1/B)`` rewrite fires only
  when ``1 - b**t`` has one use), but in x64 mode for every leaf of more than one element
  (``jax_enable_x64``: ``1 - b**t`` is a float64 power cast to float32 per leaf). With
  ``clip_by_global_norm`` in the chain LLVM swaps the ``v`` pairing of every leaf, and the ``m`` pairing
  of one-element leaves too (except in a multi-leaf tree with ``M == 1``). Clipping's ``(S_CLIP_DIV,
  S_CLIP)`` is ``(n, f(M))``, or ``(1, 1)`` when ``n < f(M)`` (as without clipping; both exact on ``g``);
  ``RN(g / n)`` is a true division (a multiply by ``1/n`` differs for 60% of elements), ``* M`` a second
  rounding (exact, and removed by XLA, when ``M == 1``).

  *Fused gradients* (a limit of any optimizer outside XLA): these pairings hold for a gradient
  that reaches the moment-update fusion materialised: always when ``update`` is jitted apart,
  and in a step jitted whole for gradients of matmuls and multi-element reductions (every leaf
  of the tests' MLP and transformer). XLA:CPU may instead fuse a gradient's computation into
  the moment updates (seen for a ``(1,)`` leaf whose gradient is a full reduction, small
  leaves with a gradient element-wise in the parameter, bf16 gradients cast in the update's
  program); LLVM then contracts the *other* products, ``OX_NU_SWAP | OX_MU_SWAP`` (with
  clipping nothing changed in the cases probed). A buffer does not tell: the JAX adapter takes
  the affected leaves as ``xla_fused_grads``. Rarer cases (a gradient XLA simplifies with the
  moment update, e.g. of a loss quadratic in a scalar) match no pairing. Verified
  (tests/test_jax_compose.py): ``optax.chain(optax.clip_by_global_norm(M), adamw)``'s clipped
  gradient (``max_norm=M``'s pairing without :data:`OX_CLIP`:
  ``after_clip_by_global_norm=M``), ``optax.MultiSteps``'s accumulated one
  (``xla_fused_grads=True``). Not reproduced: a ``lax.pmean`` of gradients fused into the
  update under ``jax.pmap`` (several leaves match no code; reduced in a program of their own
  they are exact), and in x64 mode float64 gradients cast to float32 in the update's program.

  A custom call hands ``u`` back to the program, where ``scale_by_learning_rate`` and
  ``apply_updates`` fuse into the same ``fma(f(-lr), u, p)``. ``apply_updates`` jitted *apart*
  from ``update`` rounds ``RN(-lr*u)`` before ``p + that``: not a convention here.

  *Without FMA* (XLA:CPU targeting an ISA without FMA3: ``--xla_cpu_max_isa=SSE4_2`` or ``AVX``,
  or such a host; :data:`OX_NO_FMA`): every ``fma(a, b, c)`` above is ``RN(RN(a*b) + c)`` (each
  result flushed), whatever the pairing bits. Verified bit for bit at ``SSE4_2`` and ``AVX``
  (3- and 7-leaf MLPs, a single leaf, with and without clipping); at ``AVX2`` and ``AVX512`` the
  fused lines hold. The adapter probes XLA:CPU with one jitted ``a*b + c`` (``powf`` and the bias
  corrections did not change).

platform ``cuda`` (XLA:GPU, measured on the H200; no FMA contraction was seen there)::

      g  = g * c                                   # c: the clip coefficient, S_CLIP
      g  = (g / n) * M                             # instead, with OX_CLIP (clip_by_global_norm)
      m  = f(1-b1) * g + f(b1) * m                 # two roundings each, no FMA
      v  = f(1-b2) * (g * g) + f(b2) * v
      u  = m / (d1 * (sqrt(v / d2) + f(eps)))      # XLA folds (m/d1)/(...) into one divide
      u  = u + f(wd) * p                           # add_decayed_weights
      p  = p + u * f(-lr)                          # scale_by_learning_rate, apply_updates

  ``sqrt`` is the approximate ``sqrt.approx.f32`` (division ``div.full.f32``), which a host
  cannot reproduce: the host kernels use IEEE operations (:data:`OPTAX_CUDA_MAX_ULP`). The
  device kernel runs XLA:GPU's instructions and matched jitted ``optax.adamw`` on the H200 bit
  for bit per step (warmup-cosine schedule, decay mask, five leaves, fp32 and bf16 with an fp32
  master, with and without clipping; tests/test_jax_gpu.py). ``d1``, ``d2``, ``-lr``
  (``__nv_powf``/``__nv_cosf``) and the norm come from the user's program: with clipping the
  weights equal optax's when both programs compute the same norm. XLA:GPU keeps denormals (no
  FTZ unless ``xla_gpu_ftz``) and never rewrites to reciprocals (form D); ``cuda`` reads only
  the :data:`OX_CLIP` bit of the code.

Numerical hazards: ``1 - lr*wd`` and ``-lr/bc1`` are rounded to float32 once (not per element);
``d`` is never zero for ``eps > 0``, but an Inf/NaN gradient propagates to ``m``, ``v`` and ``p``
exactly as in the references (no guard); ``bc2`` underflows (``b2`` very close to 1, tiny ``t``)
only below float64 precision, far from any practical setting.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "CONVENTIONS", "PLATFORMS", "ITEMSIZE", "AdamWHyperParams", "validate_hyperparams", "variant_id",
    "torch_step_scalars", "optax_bias_corrections", "optax_clip_scalars", "optax_cpu_code", "optax_step_scalars",
    "optax_scalar_matrix", "OptaxStepScalars", "master_of_weights", "step_scalars", "clip_coefficient", "merge_master",
    "fma_f32", "ftz", "f32_to_bf16_bits", "bf16_bits_to_f32", "round_to", "reference_update",
]

CONVENTIONS: tuple[str, ...] = ("torch", "optax")
PLATFORMS: tuple[str, ...] = ("cpu", "cuda")
#: Bytes per element of the weight and gradient dtypes the contract covers.
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

# -- kernel variants: (convention, platform) -> small integer ------------------------------
VARIANT_TORCH_CPU = 0
VARIANT_TORCH_CUDA = 1
VARIANT_OPTAX_CPU = 2
VARIANT_OPTAX_CUDA = 3

# -- the per-step scalar vector: one index per meaning --------------------------------------
# Shared indices mean the same quantity in both conventions; each convention's own slots hold 0.0 in
# the other's vectors (1.0 in optax_scalar_matrix's rows, as jnp writes them), which its kernels never read.
# S_CLIP multiplies the gradient in both conventions: torch's c, optax's M of clip_by_global_norm when
# it triggers (else 1.0). The engine's max_grad_norm (torch's clip_grad_norm_ formula) uses it in both;
# only the JAX adapter's clip_by_global_norm inputs reproduce optax's clipping.
N_SCALARS = 16
# both conventions
S_CLIP = 0  # c: fp32 gradient multiplier (1.0 when not clipping)
S_OMB1 = 1  # f(1 - b1): torch's lerp weight, optax's weight of g in m
S_BETA2 = 2  # f(b2)
S_OMB2 = 3  # f(1 - b2)
S_EPS = 4  # f(eps)
# torch convention
S_DECAY = 5  # f(1 - lr*wd)
S_LERP_SMALL = 6  # 1.0 when f(1-b1) < 0.5, else 0.0 (which lerp formula)
S_SQRT_BC2 = 7  # f(sqrt(bc2)), a divisor
S_NEG_STEP = 8  # f(-lr/bc1)
# optax convention
S_BETA1 = 9  # f(b1)
S_BC1 = 10  # d1 = 1 - b1**t (float32, as XLA computes it)
S_BC2_OPTAX = 11  # d2 = 1 - b2**t (float32, as XLA computes it)
S_WD = 12  # f(wd); 0.0: no weight decay (wd == 0 or the leaf masked out)
S_NEG_LR = 13  # f(-lr)
S_CLIP_DIV = 14  # with OX_CLIP (cpu and cuda): the gradient divisor (global norm, or 1.0)
S_OX_CODE = 15  # the code (OX_* bits) as a float32 (cuda reads only OX_CLIP)

# -- optax/cpu codes: which form and FMA pairing XLA:CPU compiled (see the docstring) -------
OX_FORM_R = 1  # q = RN(m*r1) / (sqrt(RN(v*r2)) + eps): a single-leaf pytree, numel > 1
OX_NU_SWAP = 2  # v = fma(b2, v, RN((1-b2)*gg)) (clip in the chain, or a fused gradient)
OX_MU_SWAP = 4  # m = fma(b1, m, RN((1-b1)*g)) (one-element leaves with clip; fused gradients)
OX_CLIP = 8  # clip_by_global_norm in the chain: g divided by S_CLIP_DIV first
OX_NO_FMA = 16  # XLA:CPU without FMA3: every fma of the lines is RN(RN(a*b) + c)
OX_CODES: tuple[int, ...] = tuple(range(32))

# -- torch/cpu codes: msqrt's mode (bits 0-1, trainstream._cpu_sqrt) | TC_NO_FMA -----------
TC_NO_FMA = 4  # ATen's DEFAULT kernels: lerp and addcmul unfused (two roundings each)
TC_CODES: tuple[int, ...] = tuple(range(8))

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
#: applies to the moments.
OPTAX_CUDA_HOST_MAX_ULP = 16


class AdamWHyperParams(NamedTuple):
    """AdamW hyper-parameters of one parameter group (Python floats, float64)."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def validate_hyperparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> AdamWHyperParams:
    """Check AdamW hyper-parameters (``ValueError`` worded as ``torch.optim.AdamW``'s)."""
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


def _scalar_vector(slots: dict[int, Any]) -> np.ndarray:
    """The scalar vector holding ``slots`` (index -> value, rounded once to float32), zeros elsewhere."""
    s = np.zeros(N_SCALARS, np.float32)
    for index, value in slots.items():
        s[index] = np.float32(value)
    return s


def torch_step_scalars(hp: AdamWHyperParams, step: int, clip: float | np.float32 = 1.0) -> np.ndarray:
    """Per-step scalars of the ``torch`` convention for update number ``step`` (>= 1), as
    ``torch/optim/adam.py`` forms them in Python floats, rounded where ATen casts them."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after increment), got {step}")
    lr, b1, b2, eps, wd = hp
    t = float(step)  # torch keeps `step` as a float tensor and calls .item()
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    lerp_small = 1.0 if abs(float(np.float32(1 - b1))) < 0.5 else 0.0
    return _scalar_vector({S_CLIP: clip, S_DECAY: 1 - lr * wd, S_OMB1: 1 - b1, S_LERP_SMALL: lerp_small,
                           S_BETA2: b2, S_OMB2: 1 - b2, S_SQRT_BC2: bc2**0.5, S_EPS: eps, S_NEG_STEP: -(lr / bc1)})


def optax_bias_corrections(b1: float, b2: float, count, xp=np):
    """``(1 - b1**count, 1 - b2**count)`` in float32 as optax writes it, ``count`` the int32
    count after increment; with ``xp=jax.numpy`` in the jitted step XLA computes optax's bits
    (NumPy's power may differ from XLA's ``powf`` in the last bit: a reference only)."""
    t = xp.asarray(count, dtype=xp.int32).astype(xp.float32)
    one = xp.asarray(1, xp.float32)
    return one - xp.asarray(b1, xp.float32) ** t, one - xp.asarray(b2, xp.float32) ** t


class OptaxStepScalars(NamedTuple):
    """What :func:`optax_scalar_matrix` returns (arrays of its ``xp``)."""
    count_inc: Any  # int32: optax's count after this update (safe_increment)
    scalars: Any  # float32[leaves, N_SCALARS]: every leaf's scalar vector
    step_size: Any  # the factor of scale_by_learning_rate, as optax forms it (-lr)


def optax_scalar_matrix(count, codes, decays, *, learning_rate, b1, b2, eps, weight_decay, global_norm=None,
                        max_norm=None, xp=np) -> OptaxStepScalars:
    """The ``optax`` convention's per-step scalar matrix, one row per leaf (``codes``: each
    leaf's :func:`optax_cpu_code`; ``decays``: False for a leaf masked out of weight decay).

    Every entry is written as optax.adamw (0.2.8) writes it, so that with ``xp=jax.numpy`` in
    the caller's jitted program XLA computes the reference's bits for any hyper-parameters
    (Python floats, or float32 arrays from ``optax.inject_hyperparams``), in x64 mode too:
    ``d1 = (1 - b1**t).astype(float32)`` (the power in the ambient precision); ``f32(1 - b1)``,
    ``f32(b1)`` (weak-typed for a Python float), likewise ``b2``, ``eps``, ``weight_decay``;
    ``step_size = -1 * lr``, a schedule taken at the count *before* the increment; the clip
    slots from ``global_norm`` and ``max_norm`` on the rows whose code has :data:`OX_CLIP`.
    """
    codes = np.asarray(codes, np.int64).reshape(-1)
    decays = np.asarray(decays, bool).reshape(-1)
    n = codes.size
    f32 = np.float32
    count = xp.asarray(count, dtype=xp.int32)
    i32_max = xp.asarray(np.iinfo(np.int32).max, xp.int32)
    count_inc = xp.where(count < i32_max, count + xp.asarray(1, xp.int32), i32_max)
    if callable(learning_rate):
        step_size = xp.asarray(-1 * learning_rate(count), dtype=f32)
    else:
        step_size = -1 * learning_rate
    one = xp.asarray(1.0, f32)
    cols = [one] * N_SCALARS
    for i, x in ((S_WD, weight_decay), (S_OMB1, 1 - b1), (S_BETA1, b1), (S_BETA2, b2), (S_OMB2, 1 - b2)):
        cols[i] = xp.asarray(x, f32)
    cols[S_BC1] = xp.asarray(1 - b1**count_inc).astype(f32)
    cols[S_BC2_OPTAX] = xp.asarray(1 - b2**count_inc).astype(f32)
    cols[S_EPS] = xp.asarray(eps, f32)
    cols[S_NEG_LR] = xp.asarray(step_size, f32)
    if max_norm is not None:
        norm = xp.asarray(global_norm)
        trigger = norm < max_norm
        cols[S_CLIP_DIV] = xp.where(trigger, one, norm.astype(f32))
        cols[S_CLIP] = xp.where(trigger, one, xp.asarray(max_norm, f32))
    base = xp.stack([xp.asarray(c).astype(f32).reshape(()) for c in cols])
    keep = np.ones((n, N_SCALARS), bool)
    fixed = np.zeros((n, N_SCALARS), np.float32)
    keep[:, S_OX_CODE] = False
    fixed[:, S_OX_CODE] = codes.astype(np.float32)
    keep[~decays, S_WD] = False
    no_clip = (codes & OX_CLIP) == 0
    keep[no_clip, S_CLIP] = keep[no_clip, S_CLIP_DIV] = False
    fixed[no_clip, S_CLIP] = fixed[no_clip, S_CLIP_DIV] = 1.0
    mat = xp.where(keep, xp.broadcast_to(base, (n, N_SCALARS)), fixed)
    return OptaxStepScalars(count_inc, mat, step_size)


def master_of_weights(master, weights, xp=np):
    """The fp32 master an update of fp16/bf16 ``weights`` starts from: ``master`` where it
    rounds to ``weights``, else the weights upcast (a weight replaced outside the optimizer
    is taken as it is, as a float32 parameter would be). ``xp``: NumPy or ``jax.numpy``."""
    master = xp.asarray(master)
    weights = xp.asarray(weights)
    return xp.where(master.astype(weights.dtype) == weights, master, weights.astype(np.float32))


def optax_cpu_code(n_leaves: int, numel: int, max_norm: float | None = None, fused_grad: bool = False,
                   fma: bool = True, x64: bool = False) -> int:
    """The optax/cpu code (``OX_*`` bits) of one leaf, by the module docstring's rules: ``n_leaves``
    leaves in the optimised pytree, ``numel`` elements in this leaf; ``max_norm``: ``M`` of a
    ``clip_by_global_norm`` chained before adamw, or None; ``fused_grad``: XLA fuses this leaf's
    gradient into the moment update ("Fused gradients"; no effect with clipping); ``fma``: XLA:CPU's
    target has FMA3; ``x64``: ``jax_enable_x64`` is on."""
    code = OX_FORM_R if (numel > 1 and (n_leaves == 1 or x64)) else 0
    if not fma:
        code |= OX_NO_FMA
    if max_norm is not None:
        code |= OX_CLIP | OX_NU_SWAP
        if numel == 1 and not (n_leaves > 1 and np.float32(max_norm) == np.float32(1.0)):
            code |= OX_MU_SWAP
    elif fused_grad:
        code |= OX_NU_SWAP | OX_MU_SWAP
    return code


def optax_clip_scalars(g_norm, max_norm) -> tuple[np.float32, np.float32]:
    """``(S_CLIP_DIV, S_CLIP)`` of ``clip_by_global_norm(max_norm)`` for global norm ``g_norm``:
    optax's ``select(g_norm < M, g, (g / g_norm) * M)``, a float32 compare (a NaN norm, or
    ``g_norm == M``, clips). The JAX adapter does the same in-graph."""
    n, m = np.float32(g_norm), np.float32(max_norm)
    if n < m:
        return np.float32(1.0), np.float32(1.0)
    return n, m


def optax_step_scalars(hp: AdamWHyperParams, bc1: float | np.float32, bc2: float | np.float32,
                       clip: float | np.float32 = 1.0, *, neg_lr: float | np.float32 | None = None,
                       clip_div: float | np.float32 = 1.0, code: int = 0, decay: bool = True) -> np.ndarray:
    """Per-step scalars of the ``optax`` convention, given XLA's float32 bias corrections.

    ``bc1``, ``bc2``: ``d1``, ``d2``. ``clip``, ``clip_div``: :func:`optax_clip_scalars`.
    ``neg_lr``: ``-lr`` in float32 as XLA computed it (a schedule); default ``f(-hp.lr)``.
    ``code``: :func:`optax_cpu_code`. ``decay=False``: a leaf masked out of weight decay.
    """
    if code not in OX_CODES:
        raise ValueError(f"optax code must be one of 0..{OX_CODES[-1]}, got {code!r}")
    lr, b1, b2, eps, wd = hp
    return _scalar_vector({S_CLIP: clip, S_CLIP_DIV: clip_div, S_OX_CODE: code, S_WD: wd if decay else 0.0,
                           S_OMB1: 1 - b1, S_BETA1: b1, S_BETA2: b2, S_OMB2: 1 - b2, S_BC1: bc1, S_EPS: eps,
                           S_NEG_LR: -lr if neg_lr is None else neg_lr, S_BC2_OPTAX: bc2})


def step_scalars(hp: AdamWHyperParams, step: int, convention: str, platform: str,
                 clip: float | np.float32 = 1.0) -> np.ndarray:
    """The float32 scalar vector for ``step`` in ``convention`` on ``platform`` (optax: the
    bias corrections from NumPy; the JAX adapter calls :func:`optax_step_scalars` with XLA's)."""
    variant_id(convention, platform)
    if convention == "torch":
        return torch_step_scalars(hp, step, clip)
    bc1, bc2 = optax_bias_corrections(hp.beta1, hp.beta2, step)
    return optax_step_scalars(hp, bc1, bc2, clip)


def clip_coefficient(norm: float, max_norm: float) -> np.float32:
    """``min(1, max_norm / (norm + 1e-6))`` in float32, as ``clip_grad_norm_`` computes it
    on a float32 norm: ``max_norm / tensor`` is ``tensor.reciprocal() * max_norm`` (two
    roundings; a true division differs in the last bit for about a quarter of the inputs).
    ``norm``: the global L2 norm rounded to float32 (torch sums float32 norms; the engine's
    float64 partials may differ in the last bits). A non-finite norm gives a non-finite
    coefficient, which poisons the update exactly as torch's does."""
    with np.errstate(all="ignore"):
        recip = np.float32(1.0) / (np.float32(norm) + np.float32(1e-6))
        coef = np.float32(recip * np.float32(max_norm))
    return np.float32(min(np.float32(1.0), coef)) if not np.isnan(coef) else coef


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
    if variant == VARIANT_OPTAX_CPU:
        return _reference_optax_cpu(p, m, v, np.asarray(g, np.float32), s)
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
            u = m / (s[S_BC1] * (np.sqrt(v / s[S_BC2_OPTAX]) + s[S_EPS]))
            u = u + s[S_WD] * p
            p = p + u * s[S_NEG_LR]
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)


# -- optax/cpu: XLA:CPU arithmetic (flush-to-zero, FMA pairings, forms) -----------------------
_F32_TINY = np.float32(2.0**-126)


def ftz(x) -> np.ndarray:
    """Denormals to signed zero (XLA:CPU's FTZ on results, DAZ on operands)."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < _F32_TINY, np.copysign(np.float32(0.0), x), x).astype(np.float32)


def _reference_optax_cpu(p, m, v, g, s):
    """The optax/cpu lines of the module docstring, with FTZ/DAZ on every operation."""
    code = int(s[S_OX_CODE])
    if float(code) != float(s[S_OX_CODE]) or code not in OX_CODES:
        raise ValueError(f"scalars[S_OX_CODE] = {s[S_OX_CODE]!r} is not an optax/cpu code")
    z = ftz
    B1, C1, B2, C2 = z(s[S_BETA1]), z(s[S_OMB1]), z(s[S_BETA2]), z(s[S_OMB2])
    d1, d2, eps, wd, neg_lr = z(s[S_BC1]), z(s[S_BC2_OPTAX]), z(s[S_EPS]), z(s[S_WD]), z(s[S_NEG_LR])
    mul, div = z(s[S_CLIP]), z(s[S_CLIP_DIV])
    fma = (lambda a, b, c: z(a * b) + c) if code & OX_NO_FMA else fma_f32
    with np.errstate(all="ignore"):
        p, m, v, g = z(p), z(m), z(v), z(g)
        g = z(z(g / div) * mul) if code & OX_CLIP else z(g * mul)
        m = z(fma(B1, m, z(C1 * g))) if code & OX_MU_SWAP else z(fma(C1, g, z(B1 * m)))
        gg = z(g * g)
        v = z(fma(B2, v, z(C2 * gg))) if code & OX_NU_SWAP else z(fma(C2, gg, z(B2 * v)))
        if code & OX_FORM_R:
            r1, r2 = z(np.float32(1.0) / d1), z(np.float32(1.0) / d2)
            q = z(z(m * r1) / z(np.sqrt(z(v * r2)) + eps))
        else:
            q = z(m / z(d1 * z(np.sqrt(z(v / d2)) + eps)))
        u = z(fma(wd, p, q)) if wd != 0 else q
        p = z(fma(neg_lr, u, p))
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)


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
