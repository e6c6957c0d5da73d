"""Numba compile options and LLVM intrinsics shared by the host kernels, and what Numba's
target can run.

* **The on-disk cache.** Kernels are cached on disk (``__pycache__`` beside the package,
  else Numba's user-wide cache, or ``NUMBA_CACHE_DIR`` where the user sets it). Where none
  is writable (a read-only container with an unwritable HOME), Numba refuses
  ``cache=True`` at decoration time; then every kernel compiles in memory (:data:`CACHE`
  is False) and one warning says how to set a cache directory.
* **The instruction set.** Code that uses an instruction the target lacks aborts the whole
  process inside LLVM (no Python exception). :func:`target_features` reads the features of
  the target Numba compiles for (the host's, or what ``NUMBA_CPU_NAME`` /
  ``NUMBA_CPU_FEATURES`` force) by asking LLVM to lower two probe functions; kernels that
  need an ISA-specific instruction are built only when that feature is present.
"""

from __future__ import annotations

import functools
import warnings

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["CACHE", "OPTS", "target_features", "fma32", "bits_f32", "f32_bits"]


def _probe():  # pragma: no cover - never called; only decorated
    pass


def _cache_available() -> bool:
    try:
        numba.njit(cache=True)(_probe)
    except RuntimeError as e:  # "cannot cache function ...: no locator available for file ..."
        warnings.warn(f"TrainStream: Numba cannot cache its kernels here ({e}); they compile in memory in every "
                      "process (a few seconds each). Set NUMBA_CACHE_DIR to a writable directory to cache them.",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


#: Whether kernels are cached on disk (False where no cache directory is writable).
CACHE: bool = _cache_available()

#: Options of every host kernel: the GIL released, NumPy's error model, the disk cache.
OPTS = dict(nogil=True, cache=CACHE, error_model="numpy")

_PROBES = {
    # AVX-512F has a native unsigned 64-bit -> float conversion; without it LLVM expands it.
    "avx512f": ("define float @probe(i64 %x) {\n  %r = uitofp i64 %x to float\n  ret float %r\n}",
                "vcvtusi2ss"),
    # With FMA3, llvm.fma lowers to one instruction; without it, to a call of fmaf.
    "fma": ("declare float @llvm.fma.f32(float, float, float)\n"
            "define float @probe(float %a, float %b, float %c) {\n"
            "  %r = call float @llvm.fma.f32(float %a, float %b, float %c)\n  ret float %r\n}",
            "vfmadd"),
}


@functools.cache
def target_features() -> frozenset[str]:
    """The ISA features of Numba's compile target that the kernels care about: ``"x86"``
    (x86-64: SSE's ``rsqrtps`` is baseline), ``"fma"`` (FMA3) and ``"avx512f"``; empty on
    other architectures (aarch64), where no x86 intrinsic may be emitted."""
    import llvmlite.binding as llvm
    from numba.core.registry import cpu_target
    codegen = cpu_target.target_context.codegen()
    tm = codegen._tm  # the TargetMachine Numba compiles with (CPU name and features applied)
    triple = tm.triple
    if not triple.startswith(("x86_64", "i386", "i686", "x86")):
        return frozenset()
    found = {"x86"}
    for name, (ir_text, marker) in _PROBES.items():
        mod = llvm.parse_assembly(ir_text)
        mod.triple = triple
        mod.data_layout = str(tm.target_data)
        mod.verify()
        if marker in tm.emit_assembly(mod):
            found.add(name)
    return frozenset(found)


@intrinsic
def fma32(typingctx, a, b, c):
    """``a*b + c`` with one rounding (``llvm.fma.f32``), for float32 operands."""
    if not (a == b == c == types.float32):
        return None
    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    """Reinterpret a float32 as uint32."""
    if x != types.float32:
        return None
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def f32_bits(typingctx, u):
    """Reinterpret a uint32 as float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen
