"""The host kernels' disk cache: a second process loads them instead of compiling, and
processes that fill a cold cache at once never leave a key pointing at another's code.

Numba's cache key hashes a kernel's pickled closure; a Numba function in the closure pickles
with a fresh uuid in every process, and the cache never hit (see :mod:`trainstream._jit`).
"""

from __future__ import annotations

import json
import os
import itertools
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from numba.core.caching import IndexDataCacheFile

from trainstream import _host_kernels as H
from trainstream import _jit
from trainstream._cpu_sqrt import IEEE, MKL_SSE, available_modes
ROOT = Path(__file__).resolve().parent.parent

# One torch/cpu AdamW specialisation (MKL's root where this target has it: the blocked path)
# and one sqrt array kernel; prints their cache hits and misses and the result bits.
_SCRIPT = """
import json, sys
import numpy as np
from trainstream import _cpu_sqrt as S, _host_kernels as H
from trainstream.contract import VARIANT_TORCH_CPU, AdamWHyperParams, TorchRecipe, step_scalars
mode = int(sys.argv[1])
n = 1000
rng = np.random.default_rng(0)
p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
s = step_scalars(AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01), 1, "torch", "cpu")
H.adamw_chunk(VARIANT_TORCH_CPU, p, m, v, g, H.KIND_F32, None, H.KIND_F32, 0, n, s, mode)
root = S.sqrt_array(np.abs(g), mode)
out = {}
adamw = H._TABLE["torch", H.torch_key(TorchRecipe(), H.KIND_F32, 0, mode)]
for name, fn in (("adamw", adamw), ("sqrt", S._array_kernel(mode, False))):
    out[name] = [sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values())]
out["bits"] = [int(p.view(np.uint32).sum(dtype=np.uint64)), int(root.view(np.uint32).sum(dtype=np.uint64))]
print(json.dumps(out))
"""


def _env(cache_dir: Path, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    full.update(env, NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    return full


def _out(res) -> dict:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _run(cache_dir: Path, mode: int, **env) -> dict:
    return _out(subprocess.run([sys.executable, "-c", _SCRIPT, str(mode)], env=_env(cache_dir, **env), cwd=ROOT,
                               capture_output=True, text=True, timeout=120))


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
            if kernel == "torch" and key[:2] == (0, H.KIND_F32) and key[6] & 3 not in available_modes():
                continue  # a sqrt mode this target cannot build
            fn = H._BUILDERS[kernel](*key, cache=False).py_func
            cells = tuple(c.cell_contents for c in fn.__closure__)
            assert all(type(c) in (bool, int) for c in cells), (kernel, key, cells)
            ident = (kernel, fn.__code__.co_code, tuple(map(repr, cells)))
            assert ident not in seen, f"{kernel} {key} and {seen[ident]} share a cache key"
            # Numba's symbol and environment names and the cache's files follow the qualname
            assert fn.__qualname__ not in seen, f"{kernel} {key} and {seen[fn.__qualname__]} share a name"
            seen[ident] = seen[fn.__qualname__] = key


# -- processes that fill one cold cache at once -------------------------------------------------

def _wrong_entries(file_class, order: str, tmp: Path) -> list:
    """Two writers save different keys into one cold cache, their file operations (index read,
    index write, data write) interleaved as ``order`` says ("ABBA..."); the keys a fresh reader
    then finds mapped to the other's data (a missing key is fine: a recompile)."""
    tmp.mkdir(parents=True)
    turn = threading.Condition()
    left = list(order)
    errors = []

    def gated(who, fn):
        def op(*a):
            with turn:
                assert turn.wait_for(lambda: not left or left[0] == who, timeout=10), order
            try:
                return fn(*a)
            finally:
                with turn:
                    if left and left[0] == who:
                        left.pop(0)
                    turn.notify_all()
        return op

    def writer(who, key):
        f = file_class(str(tmp), "kernel-1.py312", "stamp")
        for name in ("_load_index", "_save_index", "_save_data"):
            setattr(f, name, gated(who, getattr(f, name)))
        try:
            f.save(key, f"code of {key}")
        except BaseException as e:  # noqa: BLE001 - reaches the test below
            errors.append(e)
        finally:
            with turn:  # a writer with fewer operations than its turns gives the rest up
                left[:] = [w for w in left if w != who]
                turn.notify_all()

    threads = [threading.Thread(target=writer, args=(who, ("sig", who))) for who in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads), errors
    reader = file_class(str(tmp), "kernel-1.py312", "stamp")
    return [who for who in "AB" if reader.load(("sig", who)) not in (None, f"code of {('sig', who)}")]


def test_concurrent_first_saves_never_map_a_key_to_another_keys_code(tmp_path):
    """Every interleaving of two first saves: with Numba's own index/data files some leave a key
    pointing at the other's machine code (what a clean clone's suite hit: 'descr is NULL');
    with the keyed data files none does."""
    orders = sorted({"".join(p) for p in itertools.permutations("AAABBB")})
    wrong = {cls.__name__: [o for i, o in enumerate(orders) if _wrong_entries(cls, o, tmp_path / f"{cls.__name__}{i}")]
             for cls in (IndexDataCacheFile, _jit._KEYED_CACHE.file_class)}
    assert wrong["IndexDataCacheFile"], "the harness no longer reproduces Numba's race"
    assert wrong["_KeyedCacheFile"] == [], wrong


_ONE_KIND = """
import json, sys
import numpy as np
from trainstream import _host_kernels as H
from trainstream.contract import VARIANT_TORCH_CPU, AdamWHyperParams, TorchRecipe, step_scalars
s = step_scalars(AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01), 1, "torch", "cpu")
out = {}
for gkind in map(int, sys.argv[1:]):
    rng = np.random.default_rng(gkind)
    p, g = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    g = g.view(np.uint16)[::2].copy() if gkind else g  # fp16/bf16 gradients: any 16-bit patterns
    m, v = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    H.adamw_chunk(VARIANT_TORCH_CPU, p, m, v, g, gkind, None, H.KIND_F32, 0, 1000, s, 0)
    fn = H._TABLE["torch", H.torch_key(TorchRecipe(), gkind, 0, 0)]
    out[gkind] = [int(p.view(np.uint32).sum(dtype=np.uint64)), sum(fn.stats.cache_hits.values())]
print(json.dumps(out))
"""


@pytest.mark.skipif(not _jit.CACHE, reason="no writable Numba cache directory here")
def test_processes_filling_a_cold_cache_at_once_load_their_own_kernels(tmp_path):
    """Three processes compile three specialisations of one kernel factory into a cold cache at
    once; a fourth loads all three from it, with the bits each compiled. (Each specialisation
    has its own index file since the key joins the qualname; a shared index's race is the
    interleaving test's above.)"""
    kinds = [H.KIND_F32, H.KIND_F16, H.KIND_BF16]
    procs = [subprocess.Popen([sys.executable, "-c", _ONE_KIND, str(k)], env=_env(tmp_path), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in kinds]
    fresh = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        fresh.update(_out(subprocess.CompletedProcess(proc.args, proc.returncode, out, err)))
    loaded = _out(subprocess.run([sys.executable, "-c", _ONE_KIND, *map(str, kinds)], env=_env(tmp_path), cwd=ROOT,
                                 capture_output=True, text=True, timeout=300))
    assert {k: bits for k, (bits, _) in loaded.items()} == {k: bits for k, (bits, _) in fresh.items()}
    # each entry is a hit unless a concurrent index write dropped it (then a recompile, same bits)
    assert sum(hit for _, hit in loaded.values()) >= 1, loaded


_SQRT = """
import json, sys
import numpy as np
from trainstream import _cpu_sqrt as S
x = np.abs(np.random.default_rng(0).standard_normal(1000)).astype(np.float32)
out = {}
for mode in map(int, sys.argv[1:]):
    fn = S._array_kernel(mode, False)
    r = fn(x)
    (res,) = fn.overloads.values()
    out[mode] = [int(r.view(np.uint32).sum(dtype=np.uint64)), sum(fn.stats.cache_hits.values()), res.fndesc.env_name]
print(json.dumps(out))
"""


@pytest.mark.skipif(not _jit.CACHE or len(available_modes()) < 2, reason="needs the disk cache and two sqrt modes")
def test_a_kernel_loaded_beside_another_specialisation_keeps_its_own_environment(tmp_path):
    """A process compiles one sqrt mode's array kernel; another compiles a second mode's first
    and then loads the first from the cache. Numba names a kernel's environment (its constants:
    the returned array's dtype) after its qualname; two closures of one factory shared it, and
    the loaded kernel could take the other's ("descr is NULL" in a clean clone's suite)."""
    first, other = available_modes()[1], available_modes()[0]
    run = lambda *modes: _out(subprocess.run([sys.executable, "-c", _SQRT, *map(str, modes)], env=_env(tmp_path),  # noqa: E731
                                             cwd=ROOT, capture_output=True, text=True, timeout=120))
    alone = run(first)
    both = run(other, first)
    assert both[str(first)][1] == 1 and both[str(other)][1] == 0  # loaded; compiled
    assert both[str(first)][0] == alone[str(first)][0]
    assert both[str(first)][2] != both[str(other)][2]


_FORK_DURING_COMPILE = r"""
import os, sys, threading, time
from trainstream import _jit  # registers the fork handler
from numba.core.compiler_lock import global_compiler_lock

inside, state = threading.Event(), {"compiled": False}

def compile_like_numba():  # every Numba compile runs under this lock
    with global_compiler_lock:
        inside.set()
        time.sleep(0.5)
        state["compiled"] = True

t = threading.Thread(target=compile_like_numba)
t.start()
inside.wait()
pid = os.fork()
if pid == 0:
    os._exit(0 if state["compiled"] else 7)  # the child's copy: was the compile over at the fork?
t.join()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.fork")
def test_fork_waits_for_a_compile_in_flight():
    """A child forked while a worker thread compiles a kernel would inherit LLVM half-way through
    the compile and abort at exit ("Values remain in symbol table!"): fork waits for the compile."""
    r = subprocess.run([sys.executable, "-c", _FORK_DURING_COMPILE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stdout + r.stderr
