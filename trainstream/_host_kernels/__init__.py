"""Numba host kernels: the AdamW updates of :mod:`trainstream.contract` (:func:`adamw_chunk`) and the master
scheme's fp32 gradient sums (:func:`accumulate_chunk`).

Kernels work on flat, contiguous 1-D buffers over a half-open ``[begin, end)`` range (worker threads run disjoint
chunks of one parameter), release the GIL and are cached on disk (a later process loads each in ~0.01 s instead of
compiling it in 3-7 s). Half-precision buffers travel as their ``uint16`` bits with a *kind* code (0 float32, 1 IEEE
float16, 2 bfloat16; Numba has no bfloat16): conversions to float32 are exact; from float32 they round to nearest
even and keep Inf and NaN, bit-identical to ``c10::Half``/``c10::BFloat16`` (NaN becomes the canonical quiet NaN).
FMA comes only from ``fma32``, where the contract has it (no fast-math).

So that the loops vectorise, each raw kernel picks a compiled specialisation from a table keyed by its codes: a
closure whose codes are compile-time constants, so its loop has no per-element branch (``numba.literally`` re-typed
on every call: ~50 ms). Closures follow :mod:`trainstream._jit`'s cache rules (helpers as module globals of
:mod:`._ops`, ``torch_cpu_sqrt(x, sqrt_mode)``, ``_DEPS``). Loops run over unsigned indices (a signed one costs a
wrap-around select per access), read scalars into locals first and choose per element by ``select``, never by
branch. ``inspect_asm`` of a cached specialisation is empty: tests/test_host_kernels.py compiles uncached copies to
check the machine code. Modules: :mod:`._ops` (intrinsics, conversions), :mod:`._optax` (the optax convention),
:mod:`._torch` (every torch recipe; the gradient sums).
"""

from __future__ import annotations

import threading

import numpy as np

from .. import contract as C
from .._cpu_sqrt import IEEE as SQRT_IEEE
from ..contract import (TC_CODES, TC_NO_FMA, VARIANT_OPTAX_CPU, VARIANT_OPTAX_CUDA, VARIANT_TORCH_CPU,
                        VARIANT_TORCH_CUDA)
from ._ops import AHEAD as _AHEAD
from ._ops import KIND_BF16, KIND_F16, KIND_F32, KINDS, fma32
from ._ops import LINE as _LINE
from ._ops import OPTS as _OPTS
from ._ops import STRIP as _STRIP
from ._ops import load as _load
from ._ops import prefetch_r as _prefetch_r
from ._ops import prefetch_w as _prefetch_w
from ._ops import round16 as _round16
from ._optax import OUT_IN_GRAD, OUT_U, build_adamw, rsqrt_estimate_array
from ._torch import W_IN_GRAD, W_NONE, W_OUT, W_SELF, build_accumulate, build_torch

__all__ = ["KIND_F32", "KIND_F16", "KIND_BF16", "KIND", "OUT_IN_GRAD", "OUT_U", "adamw_chunk", "accumulate_chunk",
           "torch_key", "fma32", "rsqrt_estimate_array"]

#: The kernels' codes of the dtypes.
KIND = {"float32": KIND_F32, "float16": KIND_F16, "bfloat16": KIND_BF16}
_OPTAX = (VARIANT_OPTAX_CPU, VARIANT_OPTAX_CUDA)
_FUSED_CODES = (0, TC_NO_FMA)


def _torch_keys() -> set:
    keys = set()
    for fam in range(len(C.FAMILIES)):
        cpu = fam < 2
        for ams in (0, 1):
            codes = sorted({c & 7 for c in TC_CODES}) if fam == 0 else _FUSED_CODES if cpu else (0,)
            for code in codes:
                for wk in KINDS:  # float32 math: the fp32 weights, or an fp32 master of fp16/bf16 weights
                    layouts = (W_NONE,) if wk == KIND_F32 else (W_OUT, W_IN_GRAD)
                    for lay in layouts:
                        for gk in ((wk,) if lay == W_IN_GRAD else KINDS):
                            keys.add((fam, KIND_F32, wk, gk, lay, ams, code))
                if code in _FUSED_CODES:  # fp16/bf16 math: state and weights in the parameter's dtype
                    for k in (KIND_F16, KIND_BF16):
                        keys.add((fam, k, k, k, W_SELF, ams, code))
    return keys


def _cuda_key_valid(gk: int, ok: int, md: int) -> bool:
    """optax/cuda's keys: fp16/bf16 state only on a leaf of its dtype, the weights in place or u out, float32 mu
    only on bf16 (the combinations :func:`trainstream.contract.optax_cuda_code` gives)."""
    if not md & C.OX_HALF:
        return True
    return gk != KIND_F32 and ok in (KIND_F32, OUT_U) and (not md & C.OX_MU_F32 or gk == KIND_BF16)


_BUILDERS = {"adamw": build_adamw, "torch": build_torch, "accumulate": build_accumulate}
_VALID_KEYS = {
    "adamw": {(vr, gk, ok, md) for vr in _OPTAX for gk in KINDS
              for ok in (KINDS if gk == KIND_F32 else KINDS + (OUT_IN_GRAD,)) + (OUT_U,)
              for md in (C.OX_CODES if vr == VARIANT_OPTAX_CPU else C.OX_CUDA_LINES)
              if vr == VARIANT_OPTAX_CPU or _cuda_key_valid(gk, ok, md)},
    "torch": _torch_keys(),
    "accumulate": {(k,) for k in KINDS},
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


def _kernel(kernel: str, key: tuple):
    return _TABLE.get((kernel, key)) or _specialisation(kernel, key)


_NO_OUT = np.empty(0, np.uint16)  # stands in for out16=None (never touched)
_NO_F32 = np.empty(0, np.float32)


def torch_key(recipe: C.TorchRecipe, gkind: int, layout: int, tc_code: int = 0, wkind: int | None = None) -> tuple:
    """The torch kernel's key (:mod:`._torch`) of ``recipe`` with a gradient buffer of ``gkind``, the weights in
    ``layout`` (of ``wkind``, default the recipe's dtype) and the torch/cpu code ``tc_code`` (its sqrt mode counts
    for CPU float32 single/foreach only)."""
    fam = C.FAMILIES.index(C.torch_family(recipe))
    mkind = KIND[C.math_dtype(recipe)]
    wkind = KIND[recipe.dtype] if wkind is None else wkind
    if mkind != KIND_F32:
        layout = W_SELF
    elif layout == W_NONE:
        wkind = KIND_F32
    code = 0 if fam >= 2 else (tc_code & 7) if fam == 0 and mkind == KIND_F32 else (tc_code & TC_NO_FMA)
    return fam, mkind, wkind, gkind, layout, int(recipe.amsgrad), code


def _segments(begin: int, end: int, tails) -> list[tuple[int, int, bool]]:
    """``[begin, end)`` cut at the sorted, disjoint ``tails`` ranges: ``(lo, hi, in a tail)`` pieces."""
    out, pos = [], begin
    for lo, hi in tails:
        if hi <= pos or lo >= end:
            continue
        if lo > pos:
            out.append((pos, lo, False))
        pos2 = min(hi, end)
        out.append((max(lo, pos), pos2, True))
        pos = pos2
    if pos < end:
        out.append((pos, end, False))
    return out


# -- the raw kernels (the engine calls these; no validation beyond the codes) ----------------
def adamw_chunk(variant, p, m, v, g, gkind, out16, okind, begin, end, s, tc_code=SQRT_IEEE, recipe=None, vmax=None,
                tails=()):
    """One AdamW update of elements ``[begin, end)`` (:mod:`trainstream.contract`).

    Without ``recipe`` (the optax convention, or the torch convention's default fp32 arithmetic by ``variant``):
    ``p`` fp32 master and ``m``/``v`` fp32 moments, updated in place (optax/cpu's fp16/bf16 families,
    :func:`~trainstream.contract.optax_family`: ``p``, ``v`` and (without ``OX_MU_F32``) ``m`` the uint16 bits of
    ``gkind``, ``OX_MU_BF16``: ``m`` bfloat16 bits; ``okind`` 0 or :data:`OUT_U`); ``g`` the gradient (float32 for
    ``gkind`` 0, uint16 bits for 1 fp16 / 2 bf16); ``out16`` (uint16, or None) receives the new weights rounded to
    ``okind`` (1 fp16, 2 bf16; 0 nothing), and may be ``g`` itself (``okind == gkind``: each gradient is read before
    its weight overwrites it). ``okind`` :data:`OUT_U` (optax only): ``out16`` receives ``u`` (float32, or the
    leaf's bits for fp16/bf16 state); ``p`` is only read. ``s``: the contract's scalar vector (the optax code in
    ``s[S_OX_CODE]``); ``tc_code``: the torch/cpu code. With ``recipe`` (a :class:`~trainstream.contract.TorchRecipe`;
    ``variant`` is ignored): ``m``, ``v`` and (amsgrad) ``vmax`` in the state dtype (float32, or the uint16 bits of
    fp16/bf16); without a master (fp16/bf16 state) ``p`` is None and ``out16`` holds the weights' bits, read and
    written; else as above, ``okind`` the parameter's kind. ``s``: :func:`~trainstream.contract.torch_scalars`'
    vector; ``tails``: the slot's :func:`~trainstream.contract.torch_cpu_tails`. Unchecked: buffers must be
    C-contiguous, long enough, and disjoint but for ``out16 is g`` (the callers check)."""
    if recipe is None and variant in _OPTAX:
        mode = int(s[C.S_OX_CODE]) & (-1 if variant == VARIANT_OPTAX_CPU else ~C.OX_CLIP)  # cuda: clip at run time
        if okind == OUT_U:
            want = np.uint16 if mode & C.OX_HALF and not mode & C.OX_MU_F32 else np.float32  # u in optax's dtype
            if out16 is None or out16.dtype != want:
                raise ValueError(f"adamw_chunk: okind OUT_U with optax code {mode} writes u into a {np.dtype(want)} "
                                 "out")
        elif out16 is None:
            okind, out16 = KIND_F32, _NO_OUT
        elif out16 is g and okind != KIND_F32:
            if okind != gkind:
                raise ValueError(f"adamw_chunk: weights written into the gradient buffer must keep its kind ({gkind}), "
                                 f"got {okind}")
            okind, out16 = OUT_IN_GRAD, _NO_OUT
        _kernel("adamw", (variant, gkind, okind, mode))(p, m, v, g, out16, begin, end, s)
        return
    if recipe is None:
        if variant not in (VARIANT_TORCH_CPU, VARIANT_TORCH_CUDA):
            raise ValueError(f"adamw_chunk: no specialisation for codes {(variant, gkind, okind)}")
        platform = "cpu" if variant == VARIANT_TORCH_CPU else "cuda"
        recipe = C.TorchRecipe(C.resolve_impl(platform), platform, "float32")
    if C.math_dtype(recipe) != "float32":
        layout, w, p = W_SELF, out16, _NO_F32
    elif out16 is None or okind in (KIND_F32, OUT_U):
        layout, w = W_NONE, _NO_OUT
    elif out16 is g:
        if okind != gkind:
            raise ValueError(f"adamw_chunk: weights written into the gradient buffer must keep its kind ({gkind}), "
                             f"got {okind}")
        layout, w = W_IN_GRAD, _NO_OUT
    else:
        layout, w = W_OUT, out16
    fn = _kernel("torch", torch_key(recipe, gkind, layout, tc_code, okind if layout in (W_OUT, W_IN_GRAD) else None))
    if vmax is None:
        vmax = m[:0]
    if not tails:
        fn(p, w, m, v, vmax, g, begin, end, s, False)
        return
    for lo, hi, tail in _segments(int(begin), int(end), tails):
        fn(p, w, m, v, vmax, g, lo, hi, s, tail)


def accumulate_chunk(acc, g, gkind, begin, end, fresh):
    """``acc[begin:end] = g`` (``fresh``) or ``+= g`` in float32, ``g`` of ``gkind`` upcast exactly."""
    _kernel("accumulate", (gkind,))(acc, g, begin, end, bool(fresh))
