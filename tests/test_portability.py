"""Runs on any host: each narrower instruction-set level that the references dispatch to,
forced, each in a subprocess (the levels are read once per process).

A level forces all four at once, consistently: Numba's compile target
(``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``), ATen's kernels (``ATEN_CPU_CAPABILITY``), MKL's
code path (``MKL_ENABLE_INSTRUCTIONS``) and XLA:CPU's (``--xla_cpu_max_isa``). Under each,
every kernel must compile (an instruction the target lacks aborts the process inside LLVM)
and the CPU conventions must stay bit-identical to torch.optim.AdamW and jitted optax.adamw
(the tests marked ``isa``). The host's own level is the rest of the suite.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: name -> (the Numba feature the host needs for it, the environment that forces it)
LEVELS = {
    "avx2": ("fma", dict(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="", ATEN_CPU_CAPABILITY="avx2",
                         MKL_ENABLE_INSTRUCTIONS="AVX2", XLA_FLAGS="--xla_cpu_max_isa=AVX2")),
    # AVX without FMA3: XLA:CPU's AVX level (no contraction), MKL's AVX path
    "avx": ("fma", dict(NUMBA_CPU_NAME="sandybridge", NUMBA_CPU_FEATURES="", ATEN_CPU_CAPABILITY="default",
                        MKL_ENABLE_INSTRUCTIONS="AVX", XLA_FLAGS="--xla_cpu_max_isa=AVX")),
    "sse4.2": ("x86", dict(NUMBA_CPU_NAME="nehalem", NUMBA_CPU_FEATURES="", ATEN_CPU_CAPABILITY="default",
                           MKL_ENABLE_INSTRUCTIONS="SSE4_2", XLA_FLAGS="--xla_cpu_max_isa=SSE4_2")),
}
#: tests a level leaves out (``-k``): at SSE4.2 ATen runs the same DEFAULT kernels as at the AVX level and no FMA
#: either, so torch's fp16/bf16 lines are AVX's (every kernel still compiles there: test_every_kernel_compiles_and_runs);
#: what differs there is MKL's and XLA's code, which the float32 and optax tests cover ("float16" also matches
#: "bfloat16"; the thread-chunk tests are fp16/bf16 only). At AVX, Numba's target has the features of SSE4.2's
#: (:func:`trainstream._jit.target_features`: no FMA, no AVX-512F), so the kernels ask LLVM for the same
#: instructions, and what compiles for the narrower SSE4.2 target compiles for AVX: the compile of every kernel is
#: SSE4.2's (the bit-identity tests compile and run theirs at both levels)
SKIP = {"avx": "not test_every_kernel_compiles_and_runs", "sse4.2": "not float16 and not thread_chunks"}


@functools.cache
def _host_features() -> frozenset[str]:
    """The host's own Numba target features, not a target forced by this process's environment."""
    code = "from trainstream._jit import target_features as f; print(' '.join(sorted(f())))"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return frozenset(out.stdout.split())


def _not_forced(level: str) -> str | None:
    """Why ``level`` is not forced on this host, or None."""
    need = LEVELS[level][0]
    if need not in _host_features():
        return f"the host lacks {need!r}: level {level} cannot be forced here"
    if level == "avx2" and "avx512f" not in _host_features():
        return "AVX2 is this host's own level (no avx512f): the rest of the suite runs at it"
    return None


def _isa_files() -> list[str]:
    """The test files that hold ``isa``-marked tests (collecting only those keeps each
    level's start-up short)."""
    return sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                  if "mark.isa" in f.read_text())


@pytest.fixture(scope="module")
def levels():
    """Every level's subprocess, started at once (they compile the kernels for their own
    target, mostly single-threaded: run side by side they take about half the time)."""
    if os.environ.get("NUMBA_CPU_NAME"):
        pytest.skip("this process already runs under a forced level")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "isa", *_isa_files()]
    procs = {}
    for level, (_, env) in LEVELS.items():
        if _not_forced(level) is None:
            # JAX on XLA:CPU (what --xla_cpu_max_isa narrows), also on a machine with a GPU
            extra = ["-k", SKIP[level]] if level in SKIP else []
            procs[level] = subprocess.Popen(cmd + extra, cwd=ROOT, env={**os.environ, **env, "JAX_PLATFORMS": "cpu"},
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("level", list(LEVELS))
def test_forced_isa_level(level, levels):
    _, env = LEVELS[level]
    if level not in levels:
        pytest.skip(_not_forced(level))
    try:
        out, err = levels[level].communicate(timeout=900)
    except subprocess.TimeoutExpired:
        levels[level].kill()
        raise
    tail = (out[-6000:] + "\n" + err[-3000:]).strip()
    assert levels[level].returncode == 0, f"level {level} ({env}) failed, rc={levels[level].returncode}:\n{tail}"
    assert " passed" in out and " failed" not in out, tail


@pytest.mark.isa
def test_every_kernel_compiles_and_runs():
    """Every kernel, and each specialisation whose instructions depend on the target (every
    torch/cpu sqrt mode it can compile, fused and not; the fp16/bf16 and fused recipes with and
    without FMA; optax/cpu with and without FMA), builds and runs on a few elements; a missing
    instruction would abort the process."""
    import numpy as np

    from trainstream import contract as C
    from trainstream import _cpu_sqrt as S
    from trainstream import _host_kernels as K

    n = 37
    hp = C.AdamWHyperParams(0.1, 0.9, 0.999, 1e-8, 0.01)
    half = {"float16": 0x3800, "bfloat16": 0x3F00}  # 0.5
    recipes = [(C.TorchRecipe(), m | f) for m in S.available_modes() for f in (0, C.TC_NO_FMA)]
    recipes += [(C.TorchRecipe(impl, "cpu", dt, amsgrad=True, decoupled=False), f)
                for impl, dt in (("single", "bfloat16"), ("fused", "float16"), ("fused", "float32"))
                for f in (0, C.TC_NO_FMA)]
    recipes += [(C.TorchRecipe(impl, "cuda", dt), 0) for impl, dt in (("foreach", "float32"), ("single", "float16"),
                                                                     ("fused", "bfloat16"))]
    recipes += [(C.TorchRecipe("foreach", "cuda", "bfloat16", master=True), 0)]
    for recipe, code in recipes:
        recipe = C.check_recipe(recipe)
        sd, kind = C.state_dtype(recipe), K.KIND[recipe.dtype]
        st = [np.zeros(n, np.float32 if sd == "float32" else np.uint16) for _ in range(3)]
        p = np.ones(n, np.float32) if sd == "float32" else None
        w = np.full(n, 0x3F80 if recipe.dtype == "bfloat16" else 0x3C00, np.uint16) if recipe.dtype != "float32" else None
        g = np.full(n, 0.5, np.float32) if recipe.dtype == "float32" else np.full(n, half[recipe.dtype], np.uint16)
        s = C.torch_scalars(recipe, hp, 1)
        K.adamw_chunk(0, p, st[0], st[1], g, kind, w, kind, 0, n, s, code, recipe=recipe, vmax=st[2] if recipe.amsgrad
                      else None, tails=C.torch_cpu_tails(recipe, n, code))
        assert (p != 1).all() if p is not None else (w != (0x3F80 if recipe.dtype == "bfloat16" else 0x3C00)).all(), \
            (recipe, code)
    for code in (0, 15, C.OX_NO_FMA, 31):
        p, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
        s = C.optax_step_scalars(hp, *C.optax_bias_corrections(0.9, 0.999, 1), code=code)
        K.adamw_chunk(C.VARIANT_OPTAX_CPU, p, m, v, np.full(n, 0.5, np.float32), 0, None, 0, 0, n, s)
        assert np.isfinite(p).all() and (p != 1).all(), code
    for kind in (K.KIND_F32, K.KIND_F16, K.KIND_BF16):
        acc = np.zeros(n, np.float32)
        K.accumulate_chunk(acc, np.full(n, 0x3C00 if kind == K.KIND_F16 else 0x3F80, np.uint16) if kind
                           else np.ones(n, np.float32), kind, 0, n, True)
        assert (acc == 1).all(), kind
