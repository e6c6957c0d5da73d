"""experiments/derive_xla_gpu_lines.py (issue 35 item 4): XLA:GPU's lines for optax.adamw's 16-bit state, mu_dtype,
nesterov, eps_root and eps == 0, checked against the bits probe_xla_gpu_optax.py recorded on an H100: every moment and
every 16-bit output bit for bit; float32 updates within the approximate instructions' reach (IEEE stand-ins here)."""

from __future__ import annotations

import numpy as np

from _experiments import EXPERIMENTS, load_script

DATA = EXPERIMENTS / "data" / "2026-12-07_s_h100" / "xla_gpu_optax.npz"


def test_first_line_is_its_command():
    assert (EXPERIMENTS / "derive_xla_gpu_lines.py").read_text().splitlines()[0].startswith(
        "# Run (any machine): python experiments/derive_xla_gpu_lines.py")


def test_the_lines_reproduce_the_recorded_bits():
    derive = load_script("derive_xla_gpu_lines")
    res = derive.check(np.load(DATA))
    assert {name for name, _, _ in res} == {"bf16", "fp16", "bf16_mu32", "bf16_nesterov", "fp32_mu16",
                                             "fp32_nesterov", "fp32_eps_root", "fp32_eps0"}
    for (name, count, key), (n, mx, dtype) in res.items():
        if dtype != "float32" or key in ("new_mu", "new_nu"):
            assert n == 0, (name, count, key)
        elif key == "u" and name != "fp32_nesterov":  # the approximate sqrt/rsqrt/division alone
            assert mx <= 8, (name, count, key, mx)
    assert derive.main(["--npz", str(DATA)]) == 0


def test_a_wrong_line_is_caught(monkeypatch):
    """A wrong constant (b2 = 0.99, whose bfloat16 rounding is not 1.0 as 0.999's is): bfloat16 nu differs."""
    derive = load_script("derive_xla_gpu_lines")
    monkeypatch.setattr(derive, "B2", 0.99)
    res = derive.check(np.load(DATA))
    assert res[("bf16", 4, "new_nu")][0] > 0


def test_the_contracts_lines_are_the_derived_ones():
    """trainstream.contract's optax/cuda lines (what the CUDA kernels implement, with XLA:GPU's instructions) give
    the derivation's bits on every recorded configuration: the same elements differ, by the same ulps."""
    derive = load_script("derive_xla_gpu_lines")
    data = np.load(DATA)
    assert derive.check(data, derive.contract_lines) == derive.check(data)


def test_lines_not_derived_are_refused():
    from trainstream import contract as C
    import pytest

    for args, kw in ((("float16", "float16", "float16", False), dict(eps_zero=False)),
                     (("bfloat16", "bfloat16", "bfloat16", False), dict(eps_zero=False, clip=True)),
                     (("float16", "float32", "float16", False), dict(eps_zero=True)),
                     (("float32", "bfloat16", "float32", False), dict(nesterov=True)),
                     (("bfloat16", "bfloat16", "bfloat16", False), dict(nesterov=True, numel=1)),
                     (("float16", "float16", "float16", False), dict(eps_zero=True, b_half=True))):
        kw = {"nesterov": False, "eps_zero": False, "eps_root": False, "clip": False, **kw}
        with pytest.raises(NotImplementedError, match="not derived"):
            C.optax_cuda_code(*args, **kw)
    assert C.optax_cuda_code("bfloat16", "float32", "float32", True, nesterov=True, eps_zero=False, eps_root=True,
                             clip=True) == C.OX_CLIP | C.OX_NESTEROV  # an fp32 master: the float32 lines
