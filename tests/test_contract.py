"""The NumPy statement of the contract against the real references (torch on CPU)."""

import numpy as np
import pytest

from trainstream import contract as C

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.isa  # every test here also runs under the forced ISA levels


def torch_sqrt(x):
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).sqrt().numpy()


def torch_lerp_fused() -> bool:
    """Whether ATen fuses lerp/addcmul here (its AVX2/AVX-512 kernels; not DEFAULT)."""
    from trainstream import _cpu_sqrt as S

    fused = S.detect_lerp_fma(lambda a, b, w: torch.from_numpy(a.copy()).lerp_(torch.from_numpy(b), w).numpy())
    assert fused is not None, "torch's lerp is neither fused nor two roundings"
    return fused


def test_lerp_fusing_follows_aten_capability():
    """ATen's DEFAULT kernels are the unfused ones (TC_NO_FMA), its vector kernels fused."""
    assert torch_lerp_fused() == (torch.backends.cpu.get_cpu_capability() != "DEFAULT")


def test_cpu_sqrt_mode_reproduces_torch_exhaustively_on_1_4():
    from trainstream import _cpu_sqrt as S

    mode = S.detect_mode(torch_sqrt)
    assert mode is not None, "no MKL sqrt path reproduces torch.sqrt on this machine"
    x = np.arange(0x3F800000, 0x40800000, 7, dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(S.sqrt_array(x, mode).view(np.uint32), torch_sqrt(x).view(np.uint32))
    special = np.array([0.0, -0.0, np.inf, 1e-45, 1e-40, 3e38, 2.0**-100], np.float32)
    np.testing.assert_array_equal(S.sqrt_array(special, mode).view(np.uint32),
                                  torch_sqrt(special).view(np.uint32))


def _torch_adamw_run(p0, grads, hp, clip=None, foreach=False):
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([p], lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=foreach)
    out = []
    for i, g in enumerate(grads):
        p.grad = torch.from_numpy(g.copy())
        if clip is not None:
            p.grad.mul_(torch.tensor(clip[i], dtype=torch.float32))
        opt.step()
        st = opt.state[p]
        out.append((p.detach().numpy().copy(), st["exp_avg"].numpy().copy(),
                    st["exp_avg_sq"].numpy().copy()))
    return out


@pytest.mark.parametrize("n", [1, 7, 4095, 4097, 65537])
@pytest.mark.parametrize("hp", [
    C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01),
    C.AdamWHyperParams(3e-2, 0.3, 0.95, 1e-6, 0.0),   # lerp weight >= 0.5
    C.AdamWHyperParams(1e-2, 0.5, 0.99, 1e-8, 0.1),   # lerp weight exactly 0.5
])
def test_torch_cpu_reference_bitwise(n, hp):
    rng = np.random.default_rng(n)
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
             for _ in range(50)]
    clip = [np.float32(rng.uniform(0.1, 1.0)) for _ in range(50)]
    ref = _torch_adamw_run(p0, grads, hp, clip)
    fused = torch_lerp_fused()
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for t, g in enumerate(grads, 1):
        s = C.step_scalars(hp, t, "torch", "cpu", clip=clip[t - 1])
        p, m, v = C.reference_update(p, m, v, g, s, "torch", "cpu", sqrt=torch_sqrt, fma=fused)
        rp, rm, rv = ref[t - 1]
        np.testing.assert_array_equal(m, rm, err_msg=f"exp_avg step {t}")
        np.testing.assert_array_equal(v, rv, err_msg=f"exp_avg_sq step {t}")
        np.testing.assert_array_equal(p, rp, err_msg=f"param step {t}")


def test_block_sqrt_equals_the_scalar_form_in_every_mode():
    """The kernels take MKL's root 16 lanes at a time (torch_cpu_sqrt_block): the same
    bits as the scalar form, for every mode this CPU can run, on ordinary values, the
    special inputs and random bit patterns (NaNs, subnormals, negatives, huge)."""
    from trainstream import _cpu_sqrt as S

    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([
        S.probe_values(),
        (rng.standard_normal(1 << 16).astype(np.float32)) ** 2,
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3.4e38, 2e-25, 5e-25, 8.271806125530277e-25],
                 np.float32),
        bits.view(np.float32),
        np.ones(7, np.float32),  # a tail shorter than a block
    ])
    modes = S.available_modes()
    for mode in modes:
        a = S.sqrt_array(x, mode)
        b = S._array_kernel(mode, True)(np.ascontiguousarray(x, np.float32))  # the kernels' blocked form
        same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
        assert same.all(), (S.MODE_NAMES[mode], x[~same][:5])


def test_vector_width_follows_aten_capability():
    """The probe's TC_VEC512 (64-byte vectors: the scalar tails' lengths) is ATen's AVX-512 level; at DEFAULT every
    fp16/bf16 add(alpha=) element takes the two-rounding form (no tail to measure) and TC_NO_FMA is set."""
    from trainstream.backends.torch import _l2_tail_width, torch_cpu_code

    cap = torch.backends.cpu.get_cpu_capability()
    code, width = torch_cpu_code(), _l2_tail_width()
    if cap == "DEFAULT":
        assert width is None and code & C.TC_NO_FMA
    else:
        assert width == (64 if cap.startswith("AVX512") else 32) and not code & C.TC_NO_FMA
        assert bool(code & C.TC_VEC512) == (width == 64)
