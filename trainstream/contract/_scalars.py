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
N_SCALARS = 24
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
S_OX_CODE = 15  # the code (OX_* bits) as a float32 (cuda: optax_cuda_code's bits)
# torch recipes (TorchRecipe), appended
S_GRAD_DIV = 16  # fused: GradScaler's scale, g = g / scale (1.0: none)
S_L2 = 17  # Adam's L2 weight decay, g += p * S_L2: f(wd), or R(wd) on CPU fp16/bf16 tensors; 0.0: none (AdamW)
S_INV_SQRT_BC2 = 18  # cuda single-tensor: f(1 / sqrt(bc2)), the reciprocal of the CPU scalar in float64
S_NEG_LR_WD = 19  # cuda fused AdamW: -RN(f(lr) * f(wd)), p1 = fma(S_NEG_LR_WD, p, p); 0.0: none
S_STEP = 20  # cuda fused on the device: the float32 step t, for the kernel's own powf (the host takes S_SQRT_BC2, S_NEG_STEP)
# optax convention, appended (optax/cpu; optax/cuda: eps_root, nesterov and mu_dtype=bfloat16 lines)
S_EPS_ROOT = 21  # eps_root, added to nu_hat under the root (0.0: optax's default, the same bits as none)
S_BC1_NEXT = 22  # nesterov: 1 - b1**(t+1) (optax's bias correction of mu one step ahead)
S_BETA1_MU = 23  # b1 as it multiplies the stored mu (OX_MU_BF16: the bfloat16 constant); else S_BETA1

# -- optax/cpu codes: which form and FMA pairing XLA:CPU compiled, and the leaf's dtype family (the docstring) -
OX_FORM_R = 1  # q = RN(m*r1) / (sqrt(RN(v*r2)) + eps): a single-leaf pytree, numel > 1 (float32 mu only)
OX_NU_SWAP = 2  # v = fma(b2, v, RN((1-b2)*gg)) (clip in the chain, or a fused gradient)
OX_MU_SWAP = 4  # m = fma(b1, m, RN((1-b1)*g)) (one-element leaves with clip; fused gradients)
OX_CLIP = 8  # clip_by_global_norm in the chain: g divided by S_CLIP_DIV first
OX_NO_FMA = 16  # XLA:CPU without FMA3: every fma of the lines is RN(RN(a*b) + c)
OX_NESTEROV = 32  # nesterov=True: mu_hat = b1*m/d1n + (1-b1)*g/d1
OX_RSQRT = 64  # XLA's rewrite of m / (sqrt(v) + 0) into m * rsqrt(v) (a constant eps that is 0 in the dtype)
OX_RSQRT_DIV = 128  # XLA:CPU's float32 rsqrt is RN(1 / RN(sqrt(x))) (else the estimate and one Newton step)
OX_B1_HALF = 256  # XLA factors (1-b1)*g + b1*m -> (g + m)*b1: R(1-b1) == R(b1) (OX_MU_BF16: nesterov's numerator only)
OX_B2_HALF = 512  # likewise (1-b2)*g*g + b2*v -> (g*g + v)*b2
OX_HALF = 1024  # optax's state of an fp16/bf16 leaf: nu (and mu, but with OX_MU_F32) in its dtype, no master
OX_MU_F32 = 2048  # mu_dtype=float32 on an fp16/bf16 leaf (with OX_HALF)
OX_MU_BF16 = 4096  # mu_dtype=bfloat16 on a float32 leaf
OX_HALF_DIV = 8192  # OX_HALF on a one-element leaf: the divisions by the corrections stay divisions (no reciprocal)
OX_NUM_SWAP = 16384  # nesterov's float32 numerator fma(1-b1, gn, RN(b1*mn)) (OX_MU_BF16; OX_B2_HALF, numel > 1)


def optax_code_valid(code: int) -> bool:
    """Whether ``code`` is an optax/cpu code (:func:`optax_cpu_code` gives only these): a family (float32, its
    ``OX_MU_BF16``, ``OX_HALF`` with or without ``OX_MU_F32``) and the bits its lines read."""
    if not 0 <= code < 2 * OX_NUM_SWAP:
        return False
    if code & OX_NUM_SWAP and (not code & OX_NESTEROV or code & (OX_HALF | OX_B1_HALF)):  # read there only
        return False
    if code & OX_HALF_DIV and (not code & OX_HALF or code & (OX_B1_HALF | OX_B2_HALF)):  # b == 0.5 there: not read
        return False
    half, mixed = code & OX_HALF, code & (OX_MU_F32 | OX_MU_BF16)
    if (code & OX_MU_F32 and not half) or (code & OX_MU_BF16 and half) or (code & OX_RSQRT_DIV and not code & OX_RSQRT):
        return False
    if not half and code & OX_NESTEROV and code & OX_RSQRT:  # XLA's pairing there varies with the pytree
        return False
    if half and code & OX_CLIP:  # clipping is refused
        return False
    if half and code & OX_FORM_R and (not code & OX_MU_F32 or code & OX_HALF_DIV):  # half mu: the reciprocal always
        return False
    if half and mixed and code & (OX_RSQRT | OX_B1_HALF | OX_NU_SWAP):
        return False
    if half and not mixed and code & (OX_RSQRT_DIV | OX_NU_SWAP | OX_MU_SWAP | OX_NO_FMA):  # no FMA in those lines
        return False
    return not (code & OX_MU_BF16 and code & OX_B1_HALF and not code & OX_NESTEROV)


OX_CODES: tuple[int, ...] = tuple(c for c in range(2 * OX_NUM_SWAP) if optax_code_valid(c))


def optax_rsqrt_decay_last(code: int) -> bool:
    """Whether the float32 lines of :data:`OX_RSQRT` with weight decay contract ``wd * p`` (``fma(wd, p, RN(mh *
    rs))``) rather than ``mh * rs`` (``fma(mh, rs, RN(wd * p))``): with :data:`OX_MU_BF16`, and in form D with both
    :data:`OX_B1_HALF` and :data:`OX_B2_HALF` (measured; there, and with :data:`OX_MU_BF16` in form D, a program that
    outputs the update array besides the new weights pairs the other way: :func:`optax_rsqrt_decay_varies`)."""
    return bool(code & OX_MU_BF16 or code & OX_B1_HALF and code & OX_B2_HALF and not code & OX_FORM_R)


def optax_rsqrt_decay_varies(code: int) -> bool:
    """Whether XLA:CPU's pairing of :func:`optax_rsqrt_decay_last`'s line depends on what the program outputs (the
    new weights or the update array alone, as the contract's line; both: the other), which an ``update`` traced
    before its consumers cannot see: form D with :data:`OX_MU_BF16` or with ``b1 == b2 == 0.5``."""
    return bool(code & OX_RSQRT and not code & (OX_HALF | OX_NO_FMA | OX_FORM_R)
                and (code & OX_MU_BF16 or code & OX_B1_HALF and code & OX_B2_HALF))

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


def optax_family(code: int, dtype: str = "float32") -> tuple[str, str, str, str]:
    """The dtypes of a leaf of ``dtype`` whose code is ``code``, as optax computes them: ``(g, mu, mu state,
    update)``: the gradient's (and nu's: the leaf's, float32 for the fp32 master's lines), the pre-cast first
    moment's (``(1-b1)*g + b1*mu``), the stored mu's (``mu_dtype``), the update's."""
    g = dtype if code & OX_HALF else "float32"
    mu = g if code & OX_HALF and not code & OX_MU_F32 else "float32"
    return g, mu, "bfloat16" if code & OX_MU_BF16 else mu, mu


def _const(x, dtype: str, xp, cast: bool = False):
    """``x`` (a Python float or an array of optax's hyper-parameters) as optax's arithmetic applies it to an array of
    ``dtype``, as a float32 array: a Python float is converted to ``dtype`` (weak typing), an array promotes with
    it (``cast``: converted to ``dtype``, as ``jnp.array(x, dtype=...)``)."""
    if xp is np:  # NumPy stand-in (references and tests): ml_dtypes converts through float32
        x = np.asarray(x)
        if dtype == "float32" or (not cast and x.dtype == np.float32):  # a float32 array promotes
            return x.astype(np.float32)
        if dtype == "float16":
            return x.astype(np.float16).astype(np.float32)
        from ._reference import round_to  # noqa: PLC0415
        return round_to(x.astype(np.float32), dtype)
    dt = xp.dtype(dtype)
    return (xp.asarray(x, dt) if cast else x * xp.ones((), dt)).astype(xp.float32)


def optax_scalar_matrix(count, codes, decays, *, learning_rate, b1, b2, eps, weight_decay, global_norm=None,
                        max_norm=None, xp=np, eps_root=0.0, dtypes=None, platform: str = "cpu") -> OptaxStepScalars:
    """The ``optax`` convention's per-step scalar matrix, one row per leaf (``codes``: each
    leaf's :func:`optax_cpu_code`; ``decays``: False for a leaf masked out of weight decay;
    ``dtypes``: each leaf's dtype name, default float32).

    Every entry is written as optax.adam/adamw (0.2.8) writes it, so that with ``xp=jax.numpy`` in
    the caller's jitted program XLA computes the reference's bits for any hyper-parameters
    (Python floats, or arrays from ``optax.inject_hyperparams``), in x64 mode too:
    ``d1 = 1 - b1**t`` (the power in the hyper-parameter's precision) cast to the dtype of the moment it
    corrects (:func:`optax_family`), likewise ``d2``, ``1 - b1**(t+1)``; ``1 - b1``, ``b1``, ``b2``, ``1 - b2``,
    ``eps``, ``eps_root``, ``weight_decay`` (a schedule: at the count before the increment) as they multiply or
    add to the arrays of their dtypes; ``step_size = -1 * lr`` (a schedule: at the count before the increment,
    cast to the update's dtype); the clip slots from ``global_norm`` and ``max_norm`` on the rows whose code has
    :data:`OX_CLIP`. Each family's constants are rounded to float32 from their dtype's values (exact).
    ``platform="cuda"`` (``codes``: :func:`optax_cuda_code`'s): the corrections stay float32, each optax/cuda line
    rounds them where XLA:GPU does.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    codes = np.asarray(codes, np.int64).reshape(-1)
    decays = np.asarray(decays, bool).reshape(-1)
    n = codes.size
    dtypes = ["float32"] * n if dtypes is None else list(dtypes)
    f32 = np.float32
    count = xp.asarray(count, dtype=xp.int32)
    i32_max = xp.asarray(np.iinfo(np.int32).max, xp.int32)
    inc = lambda c: xp.where(c < i32_max, c + xp.asarray(1, xp.int32), i32_max)  # noqa: E731 (safe_increment)
    count_inc = inc(count)
    lr_fn = callable(learning_rate)
    step_size = -1 * learning_rate(count) if lr_fn else -1 * learning_rate
    wd = weight_decay(count) if callable(weight_decay) else weight_decay
    d1, d2, d1n = (xp.asarray(1 - b ** c) for b, c in ((b1, count_inc), (b2, count_inc), (b1, inc(count_inc))))
    one = xp.asarray(1.0, f32)
    rows, index = [], {}
    for i in range(n):
        g, mu, mu_state, upd = optax_family(int(codes[i]), dtypes[i])
        key = (g, mu, mu_state, upd)
        if key not in index:
            cols = [one] * N_SCALARS
            for k, x, dt in ((S_OMB1, 1 - b1, g), (S_BETA1, b1, mu), (S_BETA1_MU, b1, mu_state), (S_BETA2, b2, g),
                             (S_OMB2, 1 - b2, g), (S_EPS, eps, g), (S_EPS_ROOT, eps_root, g), (S_WD, wd, g)):
                cols[k] = _const(x, dt, xp)
            cols[S_NEG_LR] = _const(step_size, upd, xp, cast=lr_fn)
            dmu, dg = ("float32", "float32") if platform == "cuda" else (mu, g)
            cols[S_BC1], cols[S_BC1_NEXT] = (_const(d, dmu, xp, cast=True) for d in (d1, d1n))
            cols[S_BC2_OPTAX] = _const(d2, dg, xp, cast=True)
            if max_norm is not None:
                norm = xp.asarray(global_norm)
                trigger = norm < max_norm
                cols[S_CLIP_DIV] = xp.where(trigger, one, norm.astype(f32))
                cols[S_CLIP] = xp.where(trigger, one, xp.asarray(max_norm, f32))
            index[key] = len(rows)
            rows.append(xp.stack([xp.asarray(c).astype(f32).reshape(()) for c in cols]))
    base = xp.stack(rows)[np.asarray([index[optax_family(int(c), d)] for c, d in zip(codes, dtypes)], np.int64)] \
        if n else xp.zeros((0, N_SCALARS), f32)
    keep = np.ones((n, N_SCALARS), bool)
    fixed = np.zeros((n, N_SCALARS), np.float32)
    keep[:, S_OX_CODE] = False
    fixed[:, S_OX_CODE] = codes.astype(np.float32)
    keep[~decays, S_WD] = False
    no_clip = (codes & OX_CLIP) == 0
    keep[no_clip, S_CLIP] = keep[no_clip, S_CLIP_DIV] = False
    fixed[no_clip, S_CLIP] = fixed[no_clip, S_CLIP_DIV] = 1.0
    mat = xp.where(keep, base, fixed)
    return OptaxStepScalars(count_inc, mat, step_size)


def _in_dtype(x, dtype: str) -> float:
    """A Python float as a constant of ``dtype`` (:func:`_const` with NumPy)."""
    return float(_const(float(x), dtype, np))


def optax_cpu_code(n_leaves: int, numel: int, max_norm: float | None = None, fused_grad: bool = False,
                   fma: bool = True, x64: bool = False, *, dtype: str = "float32", mu_dtype: str | None = None,
                   master: bool = False, nesterov: bool = False, b1: float | None = None, b2: float | None = None,
                   eps: float | None = None, rsqrt_div: bool = False, ndim: int = 1) -> int:
    """The optax/cpu code (``OX_*`` bits) of one leaf, by the module docstring's rules: ``n_leaves``
    leaves in the optimised pytree, ``numel`` elements in this leaf; ``max_norm``: ``M`` of a
    ``clip_by_global_norm`` chained before adamw, or None; ``fused_grad``: XLA fuses this leaf's
    gradient into the moment update ("Fused gradients"; no effect with clipping); ``fma``: XLA:CPU's
    target has FMA3; ``x64``: ``jax_enable_x64`` is on. The leaf's family: ``dtype`` (its name), ``mu_dtype``
    (optax's, None: the leaf's), ``master`` (the fp32 master's float32 lines for an fp16/bf16 leaf).
    ``nesterov``; ``b1``, ``b2``, ``eps``: those that are Python numbers (None: an array, which XLA cannot fold);
    ``rsqrt_div``: XLA:CPU's rsqrt is a square root and a division here (``trainstream.backends.jax``'s probe);
    ``ndim``: the leaf's rank (a one-element leaf of rank 0 pairs otherwise than one of shape ``(1,)`` with an array
    ``b2``)."""
    half = dtype != "float32" and not master
    if master and mu_dtype not in (None, "float32"):
        raise ValueError(f"the fp32 master's lines keep mu in float32, not {mu_dtype}")
    mu = "float32" if master else dtype if mu_dtype is None or not half and mu_dtype == "float32" else mu_dtype
    if half:
        code = OX_HALF | (OX_MU_F32 if mu == "float32" else 0) | (OX_HALF_DIV if numel == 1 else 0)
        if mu not in (dtype, "float32"):
            raise ValueError(f"no optax/cpu lines for a {dtype} leaf with mu_dtype {mu}")
    else:
        code = OX_MU_BF16 if mu == "bfloat16" else 0
        if mu not in ("float32", "bfloat16", dtype):
            raise ValueError(f"no optax/cpu lines for a float32 leaf with mu_dtype {mu}")
    mixed = code & (OX_MU_F32 | OX_MU_BF16)
    math_dtype = dtype if half else "float32"
    if half and mixed and dtype == "bfloat16" and eps is not None and _in_dtype(eps, "float32") == 0.0:
        raise ValueError("no optax/cpu lines for a bfloat16 leaf with mu_dtype float32 and eps == 0 (XLA drops the "
                         "+ eps and compiles the division otherwise; not read yet)")
    if nesterov:
        code |= OX_NESTEROV
    if (not half or mu == "float32") and numel > 1 and (n_leaves == 1 or x64):  # float32 mu's divisions by d1
        code |= OX_FORM_R
    if not fma and (mixed or not half):
        code |= OX_NO_FMA
    if eps is not None and (not half or dtype == "float16" and not mixed) \
            and _in_dtype(eps, math_dtype) == 0.0:  # XLA drops + 0 and rewrites / sqrt to * rsqrt
        code |= OX_RSQRT | (OX_RSQRT_DIV if rsqrt_div and not half else 0)
    # b == 0.5: XLA factors a line of one dtype (mu's only without mu_dtype; with mu_dtype=bfloat16 the float32
    # numerator of nesterov, whose mu line keeps its form: b1 == 0.5 makes both pairings and the factoring equal)
    for b, bit in ((b1, OX_B1_HALF), (b2, OX_B2_HALF)):
        if b is not None and (bit == OX_B2_HALF or not mixed or nesterov and code & OX_MU_BF16) and \
                _in_dtype(1 - b, math_dtype) == _in_dtype(b, math_dtype):
            code |= bit
            if code & OX_HALF_DIV:
                which = 1 if bit == OX_B1_HALF else 2
                raise ValueError(f"no optax/cpu lines for a one-element {dtype} leaf with b{which} == 0.5 in the dtype")
    if nesterov and not half and not code & OX_B1_HALF and (code & OX_MU_BF16 or code & OX_B2_HALF and numel > 1):
        code |= OX_NUM_SWAP  # LLVM contracts (1-b1)*gn, not b1*mn (measured; b2 == 0.5 on a one-element leaf: b1*mn)
    if max_norm is not None:
        if half:
            raise ValueError("optax/cpu clipping (OX_CLIP) has no lines for fp16/bf16 state")
        code |= OX_CLIP | OX_NU_SWAP
        if numel == 1 and not (n_leaves > 1 and np.float32(max_norm) == np.float32(1.0)):
            code |= OX_MU_SWAP
    elif fused_grad and not half:
        code |= OX_NU_SWAP | OX_MU_SWAP
    elif b2 is None and numel == 1 and ndim >= 1 and not half:
        code |= OX_NU_SWAP  # an array b2 (inject_hyperparams): LLVM vectorises g*g*(1-b2) of a (1,) leaf, not b2*v
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
