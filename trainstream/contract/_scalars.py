"""The scalar side of :mod:`trainstream.contract`: conventions, platforms and kernel variant numbers, the layout of
the per-step scalar vector (one ``S_*`` index per meaning), the optax/cpu and torch/cpu codes, the hyper-parameters,
and the functions that form the per-step scalars as each reference forms them (NumPy; ``xp=jax.numpy`` where a
function takes ``xp``, inside the caller's jitted program). Import these names from :mod:`trainstream.contract`."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

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
# The torch recipes' values per family: trainstream.contract._torch.torch_scalars (package docstring, "torch").
# S_CLIP multiplies the gradient in both conventions: torch's c, optax's M of clip_by_global_norm when
# it triggers (else 1.0). The engine's max_grad_norm (torch's clip_grad_norm_ formula) uses it in both;
# only the JAX adapter's clip_by_global_norm inputs reproduce optax's clipping.
N_SCALARS = 21
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
# torch recipes (TorchRecipe), appended
S_GRAD_DIV = 16  # fused: GradScaler's scale, g = g / scale (1.0: none)
S_L2 = 17  # Adam's L2 weight decay, g += p * S_L2: f(wd), or R(wd) on CPU fp16/bf16 tensors; 0.0: none (AdamW)
S_INV_SQRT_BC2 = 18  # cuda single-tensor: f(1 / sqrt(bc2)), the reciprocal of the CPU scalar in float64
S_NEG_LR_WD = 19  # cuda fused AdamW: -RN(f(lr) * f(wd)), p1 = fma(S_NEG_LR_WD, p, p); 0.0: none
S_STEP = 20  # cuda fused on the device: the float32 step t, for the kernel's own powf (the host takes S_SQRT_BC2, S_NEG_STEP)

# -- optax/cpu codes: which form and FMA pairing XLA:CPU compiled (see the docstring) -------
OX_FORM_R = 1  # q = RN(m*r1) / (sqrt(RN(v*r2)) + eps): a single-leaf pytree, numel > 1
OX_NU_SWAP = 2  # v = fma(b2, v, RN((1-b2)*gg)) (clip in the chain, or a fused gradient)
OX_MU_SWAP = 4  # m = fma(b1, m, RN((1-b1)*g)) (one-element leaves with clip; fused gradients)
OX_CLIP = 8  # clip_by_global_norm in the chain: g divided by S_CLIP_DIV first
OX_NO_FMA = 16  # XLA:CPU without FMA3: every fma of the lines is RN(RN(a*b) + c)
OX_CODES: tuple[int, ...] = tuple(range(32))

# -- torch/cpu codes: msqrt's mode (bits 0-1, trainstream._cpu_sqrt) | TC_NO_FMA | TC_VEC512 ---
TC_NO_FMA = 4  # ATen's DEFAULT kernels: lerp and addcmul unfused (two roundings each)
TC_VEC512 = 8  # ATen's AVX-512 kernels: 64-byte vectors (the scalar tails' lengths); else 32 bytes
TC_CODES: tuple[int, ...] = tuple(range(16))


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
    ``torch/optim/adam.py`` forms them in Python floats, rounded where ATen casts them: those of the float32
    recipes of torch's default implementations (CPU single-tensor, CUDA foreach: the same values)."""
    from ._torch import TorchRecipe, torch_scalars  # noqa: PLC0415 (the recipes build on this module)
    return torch_scalars(TorchRecipe(), hp, step, clip)


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
