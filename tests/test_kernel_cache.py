"""The host kernels' disk cache: a second process loads them instead of compiling.

Numba's cache key hashes a kernel's pickled closure; a Numba function in the closure pickles
with a fresh uuid in every process, and the cache never hit (see :mod:`trainstream._jit`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainstream import _host_kernels as H
from trainstream._cpu_sqrt import IEEE, MKL_SSE, available_modes
from trainstream.contract import TC_NO_FMA, VARIANT_TORCH_CPU

ROOT = Path(__file__).resolve().parent.parent

# One torch/cpu AdamW specialisation (MKL's root where this target has it: the blocked path)
# and one sqrt array kernel; prints their cache hits and misses and the result bits.
_SCRIPT = """
import json, sys
import numpy as np
from trainstream import _cpu_sqrt as S, _host_kernels as H
from trainstream.contract import VARIANT_TORCH_CPU, AdamWHyperParams, step_scalars
mode = int(sys.argv[1])
n = 1000
rng = np.random.default_rng(0)
p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
s = step_scalars(AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01), 1, "torch", "cpu")
H.adamw_chunk(VARIANT_TORCH_CPU, p, m, v, g, H.KIND_F32, None, H.KIND_F32, 0, n, s, mode)
root = S.sqrt_array(np.abs(g), mode)
out = {}
for name, fn in (("adamw", H._TABLE["adamw", (VARIANT_TORCH_CPU, 0, 0, mode)]), ("sqrt", S._array_kernel(mode, False))):
    out[name] = [sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values())]
out["bits"] = [int(p.view(np.uint32).sum(dtype=np.uint64)), int(root.view(np.uint32).sum(dtype=np.uint64))]
print(json.dumps(out))
"""


def _run(cache_dir: Path, mode: int, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    full.update(env, NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(mode)], env=full, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_kernels_from_the_disk_cache(tmp_path):
    mode = MKL_SSE if MKL_SSE in available_modes() else IEEE
    first = _run(tmp_path, mode)
    assert first["adamw"] == [0, 1] and first["sqrt"] == [0, 1], first
    second = _run(tmp_path, mode)
    assert second["adamw"] == [1, 0] and second["sqrt"] == [1, 0], second
    assert second["bits"] == first["bits"]
    # another compile target (here a forced one) never loads these entries
    other = _run(tmp_path, IEEE, NUMBA_CPU_NAME="nehalem", NUMBA_CPU_FEATURES="")
    assert other["adamw"] == [0, 1] and other["sqrt"] == [0, 1], other


def test_kernel_closures_hold_plain_distinct_values():
    """Plain numbers in every closure (what keeps the key stable across processes), and a
    different closure for every specialisation (no two share an entry of the cache)."""
    seen = {}
    for kernel, keys in H._VALID_KEYS.items():
        for key in keys:
            if kernel == "adamw" and key[0] == VARIANT_TORCH_CPU and key[3] & ~TC_NO_FMA not in available_modes():
                continue  # a sqrt mode this target cannot build
            fn = H._BUILDERS[kernel](*key, cache=False).py_func
            cells = tuple(c.cell_contents for c in fn.__closure__)
            assert all(type(c) in (bool, int) for c in cells), (kernel, key, cells)
            ident = (kernel, fn.__code__.co_code, tuple(map(repr, cells)))
            assert ident not in seen, f"{kernel} {key} and {seen[ident]} share a cache key"
            seen[ident] = key
