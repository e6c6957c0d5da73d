"""The suite's process settings and its order; GPU tests carry the ``gpu`` marker and are skipped cleanly where
no GPU exists.

* **OpenMP threads sleep when idle.** torch's (and MKL's) OpenMP threads spin after each parallel region by
  default. Beside the other xdist worker and the forced-ISA subprocesses on CI's 2 cores, the spinning threads take
  the cores the workers and TrainStream's host threads need: test_torch_optimizer.py took 75 s instead of 20 s
  beside two busy processes, 32 s with ``OMP_WAIT_POLICY=PASSIVE`` (set here, before anything imports torch, for
  this process and the subprocesses it starts; a value already set is kept). Only scheduling changes: no bits.
* **The longest files first.** ``--dist loadfile`` hands whole files to the workers in the order of the
  collection, which xdist otherwise reorders by the number of tests per file (a long file of few tests, such as
  test_portability.py, would start last and run alone at the end): its reordering is switched off and the files of
  :data:`SLOW_FILES` go first, longest first.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

#: The longest files, in seconds (each alone on CI's 2 cores with a cold Numba cache, as measured): these start
#: first, longest first; the others follow in their usual order. test_portability.py's own time is its wall time
#: (its forced-ISA subprocesses run beside the workers).
SLOW_FILES = {
    "test_portability.py": 300,
    "test_jax_compose.py": 370,
    "test_host_kernels.py": 200,
    "test_host_kernels_codes.py": 120,
    "test_host_kernels_torch.py": 230,
    "test_jax_mesh.py": 200,
    "test_jax_optax_alias.py": 140,
    "test_fuzz_jax.py": 140,
    "test_experiments_jax.py": 130,
    "test_jax.py": 105,
    "test_torch_inputs.py": 80,
    "test_torch_dist.py": 55,
    "test_torch_lightning.py": 60,
    "test_jax_resident.py": 50,
    "test_torch_torchtitan.py": 35,
    "test_experiments_largest.py": 30,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the collection's order of the files
        config.option.loadscopereorder = False


def _gpu_available() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return False


def pytest_collection_modifyitems(config, items):
    weight = {}
    for item in items:  # the files in collection order; the slow ones first (a stable sort keeps each file's order)
        weight.setdefault(item.path.name, SLOW_FILES.get(item.path.name, 0))
    items.sort(key=lambda item: -weight[item.path.name])
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
