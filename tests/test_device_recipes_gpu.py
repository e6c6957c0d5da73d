"""The device kernels of torch's CUDA recipes against torch.optim.AdamW / Adam on CUDA, bit for bit (marker ``gpu``;
skipped without CuPy, a CUDA device or a CUDA torch): every case of experiments/verify_cuda_recipes.py (dtype x
implementation x configuration x size x zero-copy / GPU-resident / misaligned state, masters, GradScaler), the
placement's staged, zero-copy and resident updates over several steps, and the fused bias corrections against
torch.pow on the device. A failure prints the script's diagnosis (is it the kernel or its lines, and where)."""

from __future__ import annotations

import pytest

from _experiments import load_script

gpu = pytest.mark.gpu
V = load_script("verify_cuda_recipes")
CASES = list(V.cases())


@pytest.fixture(scope="module")
def cuda():
    pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    V.dk.compile_kernels()
    return torch


@gpu
@pytest.mark.parametrize("case", [kw for _, kw in CASES], ids=[name.replace(" ", "-") for name, _ in CASES])
def test_recipe_kernel_matches_torch_on_cuda(cuda, case):
    r = V.run_case(steps=4, **case)
    assert not r["bad"], f"{case}: {r['bad']}\n" + "\n".join(r["diag"])
    assert r["nan"] == 0 or case.get("config") == "adamw_eps8", f"NaN payloads differ in {r['nan']} elements"


@gpu
@pytest.mark.parametrize("mode", ["staged", "zero-copy", "resident"])
def test_placement_matches_torch_on_cuda(cuda, mode):
    """Several slots, kernels and launches over 5 steps on their own state (a small ring: tensors in pieces)."""
    r = V.run_placement(mode)
    assert not r["bad"], r


@gpu
def test_fused_bias_corrections_match_torch_pow_on_the_device(cuda):
    bc = V.check_bias_corrections()
    assert not any(bc.values()), bc
