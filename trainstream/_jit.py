"""Numba compile options and LLVM intrinsics shared by the host kernels, and what Numba's target can run.

* **The disk cache** (``__pycache__`` beside the package, else Numba's user-wide cache, or
  ``NUMBA_CACHE_DIR``). Where none is writable, every kernel compiles in memory (:data:`CACHE` is
  False) and one warning says how to set a cache directory.
* **The cache key.** Numba files a kernel under its signature, the target (CPU name and features,
  ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` included), its bytecode and a hash of its pickled
  closure, and drops an entry when the kernel's own source file changes. A Numba function in a
  closure pickles with a fresh uuid in every process (the cache would never hit), so closures hold
  plain numbers and flags only: kernels reach helpers as module globals, their form picked by the
  closure's compile-time constants, and hold :func:`source_stamp` of the helpers' modules.
* **Processes that compile at once** (pytest-xdist, torchrun's ranks). Numba names a new entry's
  data file by the first number its per-function index lacks: two processes saving different keys
  at once both take ``.1.nbc``, and the index can send one key to the other's machine code.
  :class:`_KeyedCache` names the data file by a hash of its key and writes it before the index: a
  lost index update costs a recompile, never the wrong code. Where Numba's cache internals differ,
  kernels compile in memory, with one warning.
* **One name per specialisation.** Numba names a compiled function, and the environment holding its
  constants, after its ``__qualname__``, argument types and a per-process counter: a kernel loaded
  from the cache could take another closure of the same factory's environment ("descr is NULL").
  Hence :func:`njit`'s ``key``, added to the qualname.
* **The instruction set.** An instruction the target lacks aborts the process inside LLVM (no
  Python exception): kernels that need one are built only where :func:`target_features` has it.
* **Fork.** Kernels compile on first use, often on a worker thread. A child forked during a compile
  would inherit LLVM half-way through it and abort at exit: ``os.fork()`` waits for Numba's compiler
  lock.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings

import numba
from llvmlite import ir
from numba import types
from numba.core.compiler_lock import global_compiler_lock
from numba.extending import intrinsic

__all__ = ["CACHE", "OPTS", "njit", "source_stamp", "target_features", "fma32", "bits_f32", "f32_bits"]

if hasattr(os, "register_at_fork"):  # see "Fork" above
    os.register_at_fork(before=global_compiler_lock.acquire, after_in_parent=global_compiler_lock.release,
                        after_in_child=global_compiler_lock.release)


def _probe():  # pragma: no cover - never called; only decorated
    pass


def _keyed_cache():
    """Numba's per-function cache, its data files named by key (module docstring); None on other Numba internals."""
    try:
        from numba.core.caching import FunctionCache, IndexDataCacheFile
    except ImportError:
        return None

    class _KeyedCacheFile(IndexDataCacheFile):
        def save(self, key, data):
            # the data first, under a name no other key has; then the index, re-read (module docstring)
            name = self._data_name(int(hashlib.sha256(self._dump(key)).hexdigest()[:15], 16))
            self._save_data(name, data)
            overloads = self._load_index()
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    class _KeyedCache(FunctionCache):
        def __init__(self, py_func):
            super().__init__(py_func)
            old = self._cache_file
            self._cache_file = _KeyedCacheFile(old._cache_path, old._index_name[:-len(".nbi")], old._source_stamp)

    _KeyedCache.file_class = _KeyedCacheFile
    return _KeyedCache


_KEYED_CACHE = _keyed_cache()


def _cache_available() -> bool:
    """Whether :data:`_KEYED_CACHE` works here, checked once on a probe function (else one warning)."""
    try:
        _KEYED_CACHE(_probe)._cache_file._data_name(1)
        return True
    except Exception as e:  # noqa: BLE001 - RuntimeError: "cannot cache function ...: no locator available ..."
        why = ("Set NUMBA_CACHE_DIR to a writable directory to cache them." if isinstance(e, RuntimeError) else
               "(This Numba's cache internals are not the ones TrainStream's concurrency-safe disk cache builds on.)")
        warnings.warn(f"TrainStream: Numba cannot cache its kernels here ({type(e).__name__}: {e}); they compile in "
                      f"memory in every process (a few seconds each). {why}", RuntimeWarning, stacklevel=2)
        return False


#: Whether kernels are cached on disk (False where no cache directory is writable).
CACHE: bool = _cache_available()

#: Options of every host kernel: the GIL released, NumPy's error model, the disk cache.
OPTS = dict(nogil=True, cache=CACHE, error_model="numpy")


def njit(*, cache: bool = CACHE, key: tuple = (), **options):
    """``numba.njit(**options)``, with ``cache`` through the keyed disk cache; ``key``: the values that
    make this function one specialisation of a factory, joined to its ``__qualname__`` (module docstring)."""
    def wrap(fn):
        if key:
            fn.__qualname__ = "__".join([fn.__qualname__, *(str(int(k)) for k in key)])
        disp = numba.njit(**options)(fn)
        if cache and CACHE:
            disp._cache = _KEYED_CACHE(fn)  # what numba.njit(cache=True) sets, keyed
        return disp
    return wrap


def source_stamp(*modules) -> int:
    """A 60-bit hash of the source code of ``modules``, for a kernel's closure: its disk-cache
    entries then go stale when any of them changes (an empty source where none is found)."""
    h = hashlib.sha256()
    for mod in modules:
        h.update((mod.__spec__.loader.get_source(mod.__name__) or "").encode())
    return int(h.hexdigest()[:15], 16)


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
    """The kernels' ISA features of Numba's compile target (the host's, or forced by ``NUMBA_CPU_NAME`` /
    ``NUMBA_CPU_FEATURES``), found by lowering :data:`_PROBES`: ``"x86"`` (x86-64: SSE's ``rsqrtps`` is
    baseline), ``"fma"`` (FMA3), ``"avx512f"``; none on other architectures (aarch64: no x86 intrinsics)."""
    import llvmlite.binding as llvm
    from numba.core.registry import cpu_target
    tm = cpu_target.target_context.codegen()._tm  # the TargetMachine Numba compiles with (CPU and features applied)
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
