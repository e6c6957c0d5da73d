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
            procs[level] = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env, "JAX_PLATFORMS": "cpu"},
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
    torch/cpu sqrt mode it can compile, fused and not; optax/cpu with and without FMA),
    builds and runs on a few elements; a missing instruction would abort the process."""
    import numpy as np

    from trainstream import contract as C
    from trainstream import _cpu_sqrt as S
    from trainstream import _host_kernels as K

    n = 37
    keys = [(C.VARIANT_TORCH_CPU, 0, 0, m | f) for m in S.available_modes() for f in (0, C.TC_NO_FMA)]
    keys += [(C.VARIANT_OPTAX_CPU, 0, 0, c) for c in (0, 15, C.OX_NO_FMA, 31)]
    keys += [(v, gk, ok, 0) for v in (C.VARIANT_TORCH_CUDA, C.VARIANT_OPTAX_CUDA)
             for gk, ok in ((0, 0), (1, 1), (2, 2), (2, K.OUT_IN_GRAD))]
    for key in keys:
        assert key in K._VALID_KEYS["adamw"], key
        p, m, v = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
        g = np.full(n, 0x3F80, np.uint16) if key[1] else np.full(n, 0.5, np.float32)
        out = np.zeros(n, np.uint16) if key[2] in (1, 2) else K._NO_OUT
        s = C.step_scalars(C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01), 1,
                           "optax" if key[0] in (C.VARIANT_OPTAX_CPU, C.VARIANT_OPTAX_CUDA) else "torch",
                           "cpu" if key[0] in (C.VARIANT_TORCH_CPU, C.VARIANT_OPTAX_CPU) else "cuda")
        if key[0] == C.VARIANT_OPTAX_CPU:
            s[C.S_OX_CODE] = key[3]
        K._specialisation("adamw", key)(p, m, v, g, out, 0, n, s)
        assert np.isfinite(p).all() and (p != 1).all(), key
