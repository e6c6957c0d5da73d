"""The torch side of :mod:`trainstream.contract`: :class:`TorchRecipe` (one name for a torch slot's arithmetic and
state layout), the per-step scalars of every recipe formed as torch forms them (:func:`torch_scalars`), and the
positions where torch's CPU kernels take their scalar tail loop (:func:`torch_cpu_tails`). The lines themselves are
the package docstring's; :mod:`._torch_reference` is their NumPy form. Import these names from
:mod:`trainstream.contract`."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ._scalars import (ITEMSIZE, PLATFORMS, S_BETA1, S_BETA2, S_CLIP, S_DECAY, S_EPS, S_GRAD_DIV, S_INV_SQRT_BC2, S_L2,
                       S_LERP_SMALL, S_NEG_LR, S_NEG_LR_WD, S_NEG_STEP, S_OMB1, S_OMB2, S_SQRT_BC2, S_STEP, TC_NO_FMA,
                       TC_VEC512,
                       AdamWHyperParams, _scalar_vector)

IMPLS: tuple[str, ...] = ("single", "foreach", "fused")
#: The per-element operation sequences (:func:`torch_family`): which lines of the package docstring a recipe runs.
FAMILIES: tuple[str, ...] = ("cpu_default", "cpu_fused", "cuda_foreach", "cuda_single", "cuda_fused")
#: torch keeps ``step`` as a float32 tensor: ``step += 1`` stops at 2**24 (the bias corrections are 1 by then).
TORCH_MAX_STEP = 1 << 24
_GRAIN = 32768  # at::internal::GRAIN_SIZE: below it, or with one thread, a CPU kernel runs one chunk


class TorchRecipe(NamedTuple):
    """A torch slot's arithmetic and state layout (package docstring, "torch").

    ``impl``: ``"single"``, ``"foreach"`` or ``"fused"`` as torch resolves it (:func:`resolve_impl`);
    ``platform``: the parameters' device, ``"cpu"`` or ``"cuda"`` (whose arithmetic; the host reproduces both);
    ``dtype``: the parameter's (``"float32"``, ``"float16"``, ``"bfloat16"``); ``master``: ``master_weights=True``,
    fp32 master and moments, the recipe's float32 arithmetic applied to the master (weights ``r(master)``);
    ``amsgrad``, ``maximize``: torch's flags; ``decoupled``: AdamW's decay (and ``Adam(decoupled_weight_decay=True)``),
    False for Adam's L2; ``lr_tensor``: ``lr`` is a 0-dim float32 CPU tensor (``hp.lr`` holds its value)."""
    impl: str = "single"
    platform: str = "cpu"
    dtype: str = "float32"
    master: bool = False
    amsgrad: bool = False
    maximize: bool = False
    decoupled: bool = True
    lr_tensor: bool = False


def resolve_impl(platform: str, *, fused: bool | None = None, foreach: bool | None = None,
                 lr_tensor: bool = False) -> str:
    """torch's choice of implementation (``torch.optim.adam``'s ``_default_to_fused_or_foreach``): ``fused=True``:
    fused; ``foreach=True``: foreach, ``False``: single-tensor; else CPU single-tensor, CUDA foreach, but
    single-tensor for a Tensor ``lr`` (without ``capturable``). ``fused=True`` with ``foreach=True``: ``RuntimeError`` as torch's."""
    if platform not in PLATFORMS:
        raise ValueError(f"Unknown platform {platform!r}; expected one of {PLATFORMS}")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if fused:
        return "fused"
    if foreach is not None:  # foreach=False: the single-tensor path, also on CUDA
        return "foreach" if foreach else "single"
    return "foreach" if platform == "cuda" and not lr_tensor else "single"


def default_recipe(platform: str, dtype: str) -> TorchRecipe:
    """The recipe of a caller that names none: TrainStream 0.1.1's fp32-master scheme on torch's default
    implementation for ``platform`` (the arithmetic every slot had before recipes)."""
    return check_recipe(TorchRecipe(resolve_impl(platform), platform, dtype, master=True))


def check_recipe(recipe: TorchRecipe) -> TorchRecipe:
    """``recipe`` if every field is known (``ValueError``/``TypeError`` naming the field otherwise), ``master``
    normalised to False for float32 parameters (the same layout and bits either way)."""
    if not isinstance(recipe, TorchRecipe):
        raise TypeError(f"expected a trainstream.contract.TorchRecipe, got {type(recipe).__name__}")
    if recipe.impl not in IMPLS:
        raise ValueError(f"TorchRecipe.impl must be one of {IMPLS}, got {recipe.impl!r}")
    if recipe.platform not in PLATFORMS:
        raise ValueError(f"TorchRecipe.platform must be one of {PLATFORMS}, got {recipe.platform!r}")
    if recipe.dtype not in ITEMSIZE:
        raise ValueError(f"TorchRecipe.dtype must be one of {tuple(ITEMSIZE)}, got {recipe.dtype!r}")
    if recipe.lr_tensor and recipe.impl == "foreach":
        raise ValueError("TorchRecipe: a Tensor lr with impl='foreach' (torch: 'lr as a Tensor is not supported for "
                         "capturable=False and foreach=True')")
    flags = {k: bool(getattr(recipe, k)) for k in ("master", "amsgrad", "maximize", "decoupled", "lr_tensor")}
    if recipe.dtype == "float32":
        flags["master"] = False
    return recipe._replace(**flags)


def state_dtype(recipe: TorchRecipe) -> str:
    """The dtype of ``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq``): float32 with a master or for float32
    parameters, else the parameter's (torch's ``zeros_like(param)``)."""
    return "float32" if recipe.master or recipe.dtype == "float32" else recipe.dtype


def math_dtype(recipe: TorchRecipe) -> str:
    """The dtype ``r`` rounds to in the recipe's lines: :func:`state_dtype` (float32 math on a master)."""
    return state_dtype(recipe)


def torch_family(recipe: TorchRecipe) -> str:
    """The recipe's operation sequence (:data:`FAMILIES`): CPU single and foreach share theirs (only scalars
    differ), CUDA's single differs from foreach in one division."""
    if recipe.platform == "cpu":
        return "cpu_fused" if recipe.impl == "fused" else "cpu_default"
    return "cuda_" + recipe.impl


def _cast(x: float, dtype: str) -> np.float32:
    """``R(x)``: the scalar rounded to float32, then to ``dtype`` (exact in float32)."""
    f = np.float32(x)
    if dtype == "float16":
        return np.float32(np.float16(f))
    if dtype == "bfloat16":
        u = np.array([f], np.float32).view(np.uint32)
        u = (u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16 << 16
        return np.float32(u.astype(np.uint32).view(np.float32)[0])
    return f


def torch_scalars(recipe: TorchRecipe, hp: AdamWHyperParams, step: int, clip: float | np.float32 = 1.0, *,
                  grad_scale: float | None = None, bias: tuple[float, float] | None = None) -> np.ndarray:
    """The scalar vector (``S_*``) of update number ``step`` (>= 1) of ``recipe``, each value formed as torch forms
    it (package docstring). ``clip``: the contract's ``c`` (``maximize`` folds in as ``-c``); ``grad_scale``:
    GradScaler's scale that the fused kernels divide by (None: none); ``bias``: CUDA fused's ``(1 - powf(B1, t),
    1 - powf(B2, t))`` as the device computed them (float32; None: the host's ``powf``, which may differ in the
    last bit: an emulation). ``hp.lr``: a Tensor lr's float32 value."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after increment), got {step}")
    fam, k = torch_family(recipe), math_dtype(recipe)
    lr, b1, b2, eps, wd = (float(x) for x in hp)
    t = float(min(int(step), TORCH_MAX_STEP))
    f32 = np.float32
    c = -f32(clip) if recipe.maximize else f32(clip)
    out = {S_CLIP: c, S_GRAD_DIV: 1.0 if grad_scale is None else f32(grad_scale)}
    decays, l2 = wd != 0 and recipe.decoupled, wd != 0 and not recipe.decoupled
    if fam == "cuda_fused":
        LR, B1, B2, WD, EPS = f32(lr), f32(b1), f32(b2), f32(wd), f32(eps)
        if bias is None:  # glibc's powf: CUDA's may differ in the last bit
            bias = (f32(1) - np.power(B1, f32(t)), f32(1) - np.power(B2, f32(t)))
        bc1, bc2 = f32(bias[0]), f32(bias[1])
        out.update({S_BETA1: B1, S_BETA2: B2, S_EPS: EPS, S_SQRT_BC2: f32(np.sqrt(bc2)),
                    S_NEG_STEP: -(LR / bc1), S_NEG_LR_WD: -(LR * WD) if decays else 0.0, S_L2: WD if l2 else 0.0,
                    S_NEG_LR: -LR, S_STEP: f32(t)})  # the device kernel forms bc1, bc2 itself from these two
        return _scalar_vector(out)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    per_op16 = fam == "cpu_default" and k != "float32"  # CPU ops on fp16/bf16 tensors: some scalars cast to k
    foreach16 = per_op16 and recipe.impl == "foreach"  # in-place _foreach_mul_(tensors, Scalar) casts it
    if recipe.lr_tensor and fam != "cpu_fused":  # 0-dim float32 tensor arithmetic (fused: .item() into double)
        flr = f32(lr)
        decay = f32(1) - flr * f32(wd)
        neg_step = -(flr / f32(bc1))
    else:
        decay, neg_step = 1 - lr * wd, -(lr / bc1)
    out.update({S_OMB1: 1 - b1, S_OMB2: 1 - b2, S_LERP_SMALL: 1.0 if abs(float(f32(1 - b1))) < 0.5 else 0.0,
                S_BETA2: _cast(b2, k) if foreach16 else b2, S_EPS: _cast(eps, k) if per_op16 else eps,
                S_DECAY: (_cast(decay, k) if foreach16 else decay) if decays else 1.0,
                S_L2: (_cast(wd, k) if per_op16 else wd) if l2 else 0.0,
                S_SQRT_BC2: math.sqrt(bc2) if fam == "cpu_fused" else bc2**0.5, S_NEG_STEP: neg_step})
    if fam == "cuda_single":
        out[S_INV_SQRT_BC2] = 1.0 / bc2**0.5  # the reciprocal of the CPU scalar, in double (measured, H100)
    return _scalar_vector(out)


def torch_cpu_tails(recipe: TorchRecipe, numel: int, tc_code: int, threads: int = 1) -> tuple[tuple[int, int], ...]:
    """The ``[lo, hi)`` ranges of a tensor of ``numel`` elements that torch's CPU kernels compute in their scalar
    tail loop, where that changes the bits (package docstring, "CPU: the ISA-dependent pieces"); ``tc_code``: the
    torch/cpu code (its :data:`TC_NO_FMA` and :data:`TC_VEC512` bits), ``threads``: ``torch.get_num_threads()`` at
    step time. ``cpu_fused``: the last ``numel % lanes`` elements. ``cpu_default`` with fp16/bf16 math and L2 decay:
    each thread chunk's last ``len % L`` elements (every element at ATen's DEFAULT level). Else none."""
    if recipe.platform != "cpu":
        return ()
    vec_bytes = 64 if tc_code & TC_VEC512 else 32
    k = math_dtype(recipe)
    if recipe.impl == "fused":
        lanes = vec_bytes // ITEMSIZE[k]  # Vectorized<scalar_t>::size()
        return ((numel - numel % lanes, numel),) if numel % lanes else ()
    if k == "float32" or recipe.decoupled:
        return ()
    if tc_code & TC_NO_FMA:
        return ((0, numel),) if numel else ()
    step = vec_bytes  # cpu_kernel_vec: 2 * Vectorized<Half/BFloat16>::size() elements per vector iteration
    if numel < _GRAIN or threads <= 1:
        bounds = [(0, numel)]
    else:
        tasks = min(int(threads), -(-numel // _GRAIN))
        size = -(-numel // tasks)
        bounds = [(b, min(numel, b + size)) for b in range(0, numel, size)]
    return tuple((e - (e - b) % step, e) for b, e in bounds if (e - b) % step)


def tails_follow_threads(recipe: TorchRecipe, tc_code: int) -> bool:
    """Whether :func:`torch_cpu_tails` of ``recipe`` depends on ``torch.get_num_threads()`` (CPU single/foreach,
    fp16/bf16 math, Adam's L2, ATen's vector kernels): the caller then reads it at every step."""
    return (recipe.platform == "cpu" and recipe.impl != "fused" and math_dtype(recipe) != "float32"
            and not recipe.decoupled and not tc_code & TC_NO_FMA)


def tail_mask(tails: tuple[tuple[int, int], ...], numel: int) -> np.ndarray:
    """:func:`torch_cpu_tails`' ranges as a boolean mask of ``numel`` elements."""
    mask = np.zeros(numel, bool)
    for lo, hi in tails:
        mask[lo:hi] = True
    return mask
