"""torch's CUDA AdamW recipes on the device kernels (``kernels/adamw_torch.cu``): which kernel runs a
:class:`TorchRecipe`, its per-step scalars (as torch 2.11 forms them on CUDA), its per-tensor flags, and the launcher.
No torch or jax import; CuPy on first launch (:mod:`trainstream._device_kernels`).

The recipe, its scalar layout and its scalars are :mod:`trainstream.contract`'s (``TorchRecipe``, ``S_*``,
``torch_scalars``); this module maps them onto the kernels. What the CUDA recipes compute, per implementation:

* ``foreach`` (torch's CUDA default) and ``single`` (``foreach=False``; a Tensor ``lr``): one kernel per tensor op,
  each result rounded to the state dtype; the same lines except the division by ``sqrt(bc2)``: ``foreach`` divides
  (``S_SQRT_BC2 = f(sqrt(bc2))``), ``single`` multiplies by ``S_INV_SQRT_BC2 = f(1 / sqrt(bc2))``, the reciprocal
  torch 2.11's ``div_true_kernel_cuda`` forms in double from the host scalar (its x86 code: ``divsd``,
  ``cvtsd2ss``), not ``RN(1 / f(sqrt(bc2)))`` (which the H100 check refuted: single fp32 ``p`` differed).
* ``fused``: float scalars (``f(lr)``, ``f(b1)``, ``f(b2)``, ``f(eps)``, ``f(wd)``, ``-RN(f(lr) * f(wd))``) and the
  float32 step ``S_STEP``; the kernel forms the bias corrections with the device's ``powf``, as torch's does.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import contract as C

__all__ = ["TorchRecipe", "state_dtype", "SCALAR_INDEX", "N_SCALARS", "F_L2", "F_DECAY", "F_MAXIMIZE",
           "F_GRAD_SCALE", "F_TORCH_VEC", "F_SINGLE", "IMPLS", "check_recipe", "recipe_kernel_name",
           "cuda_scalars", "recipe_flags", "torch_vector_path", "TorchItem", "launch_torch_multi"]

IMPLS = C.IMPLS
TorchRecipe = C.TorchRecipe
state_dtype = C.state_dtype
#: Every scalar index the kernels read: name -> index (the contract's).
SCALAR_INDEX: dict[str, int] = {k: getattr(C, k) for k in dir(C)
                                if k.startswith("S_") and isinstance(getattr(C, k), int)}
#: Length of the kernels' scalar vector (``TS_N_SCALARS``).
N_SCALARS = C.N_SCALARS

# -- per-tensor flags (TS_F_* of kernels/adamw.cu) ------------------------------------------------------------
F_L2 = 1  # Adam's L2 decay (weight_decay != 0, not decoupled)
F_DECAY = 2  # decoupled decay (weight_decay != 0)
F_MAXIMIZE = 4  # maximize (the sign is in S_CLIP)
F_GRAD_SCALE = 8  # fused with GradScaler's grad_scale: g / S_GRAD_DIV, written back
F_TORCH_VEC = 16  # fused: torch's kernel takes its 4-wide path for this tensor
F_SINGLE = 32  # op-by-op: the single-tensor path

_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def check_recipe(recipe) -> None:
    """``NotImplementedError`` naming a recipe the device kernels do not run (``ValueError`` for a malformed one)."""
    if recipe.platform != "cuda":
        raise NotImplementedError(f"{recipe!r}: the device kernels compute torch's CUDA arithmetic (platform "
                                  "'cuda'); a recipe of platform 'cpu' runs on the host placement (mode='cpu')")
    if recipe.impl not in IMPLS:
        raise NotImplementedError(f"{recipe!r}: no device kernel for impl {recipe.impl!r} (expected one of {IMPLS})")
    if recipe.dtype not in _SUFFIX:
        raise NotImplementedError(f"{recipe!r}: no device kernel for {recipe.dtype} parameters "
                                  f"(float32, float16, bfloat16)")
    if recipe.impl == "foreach" and recipe.lr_tensor:
        raise NotImplementedError(f"{recipe!r}: torch runs a Tensor lr with foreach only with capturable=True, "
                                  "which TrainStream does not offer")


def recipe_kernel_name(recipe, grad_dtype: str) -> str:
    """``adamw_torch_<ops|fused>_<weights>_<grad>_<state>`` of ``kernels/adamw_torch.cu``."""
    check_recipe(recipe)
    impl = "fused" if recipe.impl == "fused" else "ops"
    return f"adamw_torch_{impl}_{_SUFFIX[recipe.dtype]}_{_SUFFIX[grad_dtype]}_{_SUFFIX[state_dtype(recipe)]}"


def cuda_scalars(recipe, hp: C.AdamWHyperParams, step: int, *, clip: float = 1.0,
                 grad_div: float = 1.0) -> np.ndarray:
    """The float32 scalar vector (:data:`N_SCALARS`) of update number ``step`` (>= 1, the count after increment) of
    ``recipe`` on CUDA: :func:`trainstream.contract.torch_scalars` (``hp.lr``: a Tensor lr's float32 value; fused
    kernels read ``S_STEP`` and ``S_NEG_LR`` and form the bias corrections with the device's ``powf``). ``clip``: the
    gradient's multiplier (1.0: the framework clipped ``param.grad``; maximize folds in as ``-clip``). ``grad_div``:
    fused with GradScaler, the gradient's divisor (``grad_scale``)."""
    check_recipe(recipe)
    return C.torch_scalars(recipe, hp, step, clip, grad_scale=None if grad_div == 1.0 else grad_div)


def torch_vector_path(numel: int, itemsize: int, *ptrs: int) -> bool:
    """Whether ATen's fused kernel takes its 4-wide path for a tensor of ``numel`` elements whose parameter and
    gradient start at ``ptrs`` (its state tensors, torch's own allocations, are aligned): ``numel % 4 == 0`` and
    each pointer ``4 * itemsize``-aligned (MultiTensorApply's ``is_aligned``)."""
    return numel % 4 == 0 and all(int(p) % (4 * itemsize) == 0 for p in ptrs)


def recipe_flags(recipe, hp: C.AdamWHyperParams, *, grad_scale: bool = False, torch_vec: bool = False) -> int:
    """The ``TS_F_*`` flags of a tensor of ``recipe`` (``torch_vec``: :func:`torch_vector_path` of the tensor torch
    would update: the parameter, or for a master recipe its fp32 master)."""
    decay = float(hp.weight_decay) != 0.0
    flags = (F_DECAY if recipe.decoupled else F_L2) if decay else 0
    flags |= F_MAXIMIZE if recipe.maximize else 0
    if recipe.impl == "fused":
        flags |= (F_GRAD_SCALE if grad_scale else 0) | (F_TORCH_VEC if torch_vec else 0)
    elif recipe.impl == "single":
        flags |= F_SINGLE
    return flags


class TorchItem(NamedTuple):
    """One tensor of :func:`launch_torch_multi`: device pointers (``master``: the fp32 master of a master recipe
    with 16-bit weights, else 0; ``vmax``: ``max_exp_avg_sq`` with amsgrad, else 0), its element count, its scalar
    vector (:func:`cuda_scalars`), its flags (:func:`recipe_flags`) and ``base``, the index in the whole tensor of
    its first element (a staged piece)."""
    param: int
    grad: int
    master: int
    m: int
    v: int
    vmax: int
    n: int
    scalars: np.ndarray
    flags: int
    base: int = 0


def launch_torch_multi(recipe, grad_dtype, items, stream: int = 0, *, device: int | None = None,
                       max_blocks: int | None = None) -> int:
    """Queue the updates of :class:`TorchItem` tensors of ``recipe`` (one kernel: same weights, gradient and state
    dtypes, same implementation family) on ``stream``, in launches of up to ``MULTI_MAX`` tensors and
    ``SCALAR_SETS`` distinct scalar vectors. Every item is checked before anything is launched; empty ones are
    skipped. Returns the tensors launched."""
    from . import _device_kernels as dk  # noqa: PLC0415
    gd = dk._dtype_name(grad_dtype)
    name = recipe_kernel_name(recipe, gd)
    sd, pd = state_dtype(recipe), recipe.dtype
    si, pi, gi = C.ITEMSIZE[sd], C.ITEMSIZE[pd], C.ITEMSIZE[gd]
    master = pd != "float32" and sd == "float32"
    checked = []
    for k, it in enumerate(items):
        it = TorchItem(*it)
        n, dot = int(it.n), f"items[{k}]."
        if n < 0:
            raise ValueError(f"items[{k}]: n must be >= 0, got {n}")
        empty = n == 0
        ptrs = (dk._check_ptr(dot + "param", it.param, pi, empty), dk._check_ptr(dot + "grad", it.grad, gi, empty),
                dk._check_ptr(dot + "master", it.master, 4, empty or not master),
                dk._check_ptr(dot + "m", it.m, si, empty), dk._check_ptr(dot + "v", it.v, si, empty),
                dk._check_ptr(dot + "vmax", it.vmax, si, empty or not recipe.amsgrad))
        if ptrs[2] and not master:
            raise ValueError(f"items[{k}]: {pd} weights with {sd} state have no fp32 master: pass master=0")
        if ptrs[5] and not recipe.amsgrad:
            raise ValueError(f"items[{k}]: vmax (max_exp_avg_sq) is for amsgrad recipes only: pass vmax=0")
        sc = dk._scalar_vector(it.scalars, f"items[{k}]: ")
        if not empty:
            checked.append(dk.KernelItem(*ptrs, n, sc, int(it.base), int(it.flags)))
    return dk.launch_items(name, checked, stream, device, max_blocks)


def _round_to_state(x, dtype: str) -> np.ndarray:
    """float values as the stored bits of ``dtype`` (float32 as is; fp16/bf16: round to nearest even, uint16)."""
    x = np.asarray(x, np.float32).reshape(-1)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    return C.f32_to_bf16_bits(x)

