"""offload_adamw on parameters sharded with NamedSharding over a mesh of forced XLA:CPU host
devices, and under jax.distributed (2 processes x 2 devices over gloo), each bit for bit
against the same sharded program around optax.adamw. The scenarios are in
tests/_jax_mesh_scenarios.py; they run in subprocesses (XLA_FLAGS must be set before JAX
initialises), all single-process scenarios in one (JAX starts once)."""

import os
import re
import subprocess
import sys
import threading

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jax_mesh_scenarios.py")
SCENARIOS = ["fp32", "clip_2d", "bf16", "bf16_state", "explicit_axes", "orbax", "user_shard_map", "errors",
             "gpu_path", "resident"]


def _start(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the forced host devices, even beside a GPU
    root = os.path.dirname(os.path.dirname(SCRIPT))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


#: the scenario after which the processes' kernels are in the Numba cache (the float32 codes of update and of
#: chain(clip_by_global_norm, ...) over a 2 x 2 mesh): the two processes then load them, not compile each the same
#: ones at once (on a cold cache ~30 s of compiles each)
_KERNELS_CACHED_AFTER = "clip_2d"


@pytest.fixture(scope="module")
def runs():
    """Both subprocesses side by side (JAX compiles in one thread: on CI's 2 cores they
    overlap), the second started once the first has run :data:`_KERNELS_CACHED_AFTER`:
    ``{"scenarios": (exit code, output), "processes": (exit code, output)}``."""
    procs = {"scenarios": _start(*SCENARIOS)}
    lines, cached = [], threading.Event()

    def read(stream):
        for line in stream:
            lines.append(line)
            if line.startswith(f"SCENARIO {_KERNELS_CACHED_AFTER} "):
                cached.set()
        cached.set()  # (the output ended without it)

    reader = threading.Thread(target=read, args=(procs["scenarios"].stdout,), daemon=True)
    reader.start()
    out = {}
    try:
        cached.wait(timeout=400)
        procs["processes"] = _start("--processes", "2")
        text = procs["processes"].communicate(timeout=400)[0]
        out["processes"] = (procs["processes"].returncode, text)
        code = procs["scenarios"].wait(timeout=400)  # (its output drained by the reader)
        reader.join()
        out["scenarios"] = (code, "".join(lines))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out


@pytest.fixture(scope="module")
def scenarios(runs):
    return runs["scenarios"][1]


def _section(out: str, name: str) -> str:
    """The scenario's result line and the traceback printed after it."""
    m = re.search(rf"^SCENARIO {re.escape(name)} .*?(?=^SCENARIO |\Z)", out, re.M | re.S)
    return m.group(0) if m else out[-4000:]


@pytest.mark.parametrize("name", SCENARIOS)
def test_sharded_scenario(scenarios, name):
    """fp32: update + apply_updates, step, eager update (rows, columns, replicated and
    one-element-per-shard leaves; the state keeps the shardings; each callback gets its
    device's shards). clip_2d: a 2 x 2 mesh, max_grad_norm and chain(clip_by_global_norm,
    ...). bf16: fp32 masters (master_weights=True). bf16_state: optax's bf16 moments.
    explicit_axes: a mesh of Explicit axes. orbax: save / restore into an abstract target /
    resume. user_shard_map: inside the user's shard_map. errors: clear errors. gpu_path: the pinned_host path (CUDA calls
    simulated) against its single-device run. resident: gpu_state_bytes counted per device's shards."""
    assert re.search(rf"^SCENARIO {re.escape(name)} ok$", scenarios, re.M), _section(scenarios, name)


def test_jax_distributed_two_processes(runs):
    """2 processes x 2 host devices (gloo): each process's callbacks get only its own
    devices' shards; clipped updates against optax on every process (bit for bit chained
    after clip_by_global_norm, across an orbax save and restore of the sharded state; within
    1 ULP with max_grad_norm); state_dict refuses other processes' shards."""
    code, out = runs["processes"]
    assert code == 0 and all(f"SCENARIO multi_process[{i}] ok" in out for i in (0, 1)), out[-6000:]


def test_exit_with_updates_in_flight(runs):
    """The scenarios' process exits right after dispatching jitted steps: the updates
    finish before the host workers stop (no hang, no error at exit)."""
    code, out = runs["scenarios"]
    assert code in (0, 1) and "EXITING with updates in flight" in out, out[-3000:]  # 1: a scenario failed
    assert "Exception ignored" not in out and "Timeout" not in out, out[-3000:]
