"""GPU tests carry the ``gpu`` marker and are skipped cleanly where no GPU exists."""

import os

import pytest

# The JAX GPU tests compare two jitted programs bit for bit; XLA:GPU reduces with atomics
# by default, so a bias gradient (a sum over the batch) may differ in its last bits from
# one run of the *reference* to the next (seen on the H200: 2 of 5 elements of a bias
# under nnx.Optimizer). Deterministic reductions, set before JAX initialises; no effect on
# XLA:CPU.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()


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
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
