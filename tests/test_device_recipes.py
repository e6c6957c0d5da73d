"""torch's CUDA recipes on the device kernels (trainstream._device_recipes, kernels/adamw_torch.cu), on CPU: the
scalars, flags and kernel names of each recipe, the launcher's checks, the placement's use of them (no CuPy, no GPU).
Against torch on CUDA: tests/test_device_recipes_gpu.py (marker ``gpu``) and experiments/verify_cuda_recipes.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trainstream import _device_kernels as dk
from trainstream import _device_recipes as R
from trainstream import contract as C
from trainstream.core import _device as ge
import _cuda_recipes_ref as X

S = R.SCALAR_INDEX
HP = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.01)


def rec(impl="foreach", dtype="float32", **kw):
    return R.TorchRecipe(impl, "cuda", dtype, **kw)


def test_scalars_of_the_op_by_op_recipes():
    """foreach and single form the same Python-float scalars; single's divisor is the reciprocal of sqrt(bc2)
    formed in double (div_true_kernel_cuda), not the float reciprocal of f(sqrt(bc2)); maximize is S_CLIP < 0;
    Adam's L2 factor is f(wd) and its decay 1; a Tensor lr forms 1 - lr*wd and lr / bc1 in float32."""
    t = 3
    bc1, bc2 = 1 - 0.9**t, 1 - 0.999**t
    f = np.float32
    for impl in ("foreach", "single"):
        s = R.cuda_scalars(rec(impl), HP, t)
        assert s.shape == (R.N_SCALARS,) and s.dtype == np.float32
        assert s[S["S_DECAY"]] == f(1 - 1e-3 * 0.01) and s[S["S_L2"]] == 0 and s[S["S_CLIP"]] == 1
        assert s[S["S_NEG_STEP"]] == f(-(1e-3 / bc1)) and s[S["S_SQRT_BC2"]] == f(bc2**0.5)
        inv = f(1 / bc2**0.5) if impl == "single" else 0.0  # foreach divides by S_SQRT_BC2
        assert s[S["S_INV_SQRT_BC2"]] == inv and s[S["S_OMB1"]] == f(0.1) and s[S["S_LERP_SMALL"]] == 1
    # the double reciprocal is not the float one for some bc2: the case the H100 check found
    steps = range(1, 200)
    assert any(np.float32(1) / f((1 - 0.999**k) ** 0.5) != f(1 / (1 - 0.999**k) ** 0.5) for k in steps)
    s = R.cuda_scalars(rec("single", maximize=True, decoupled=False), HP, t, clip=0.5)
    assert s[S["S_CLIP"]] == -0.5 and s[S["S_DECAY"]] == 1 and s[S["S_L2"]] == f(0.01)
    s = R.cuda_scalars(rec("single", lr_tensor=True), HP, t)
    assert s[S["S_DECAY"]] == f(1) - f(f(1e-3) * f(0.01)) and s[S["S_NEG_STEP"]] == -f(f(1e-3) / f(bc1))


def test_scalars_of_the_fused_recipe():
    """Float scalars as static_cast<float> of torch's doubles, the float32 step for the device powf, -RN(lr*wd)."""
    f = np.float32
    s = R.cuda_scalars(rec("fused", "bfloat16"), HP, 7, grad_div=1024.0)
    assert s[S["S_STEP"]] == 7 and s[S["S_BETA1"]] == f(0.9) and s[S["S_BETA2"]] == f(0.999)
    assert s[S["S_NEG_LR"]] == -f(1e-3) and s[S["S_NEG_LR_WD"]] == -(f(1e-3) * f(0.01)) and s[S["S_L2"]] == 0
    assert s[S["S_GRAD_DIV"]] == 1024 and s[S["S_EPS"]] == f(1e-8)
    s = R.cuda_scalars(rec("fused", decoupled=False), HP, 7)
    assert s[S["S_NEG_LR_WD"]] == 0 and s[S["S_L2"]] == f(0.01)
    with pytest.raises(ValueError, match="step must be >= 1"):
        R.cuda_scalars(rec("fused"), HP, 0)


def test_flags_and_kernel_names():
    assert R.recipe_flags(rec(), HP) == R.F_DECAY
    assert R.recipe_flags(rec(), HP._replace(weight_decay=0.0)) == 0
    assert R.recipe_flags(rec("single", decoupled=False, maximize=True), HP) == R.F_L2 | R.F_MAXIMIZE | R.F_SINGLE
    assert R.recipe_flags(rec("fused"), HP, grad_scale=True, torch_vec=True) == \
        R.F_DECAY | R.F_GRAD_SCALE | R.F_TORCH_VEC
    assert R.recipe_flags(rec("foreach"), HP, grad_scale=True, torch_vec=True) == R.F_DECAY  # fused only
    assert R.torch_vector_path(8, 2, 64, 8) and not R.torch_vector_path(8, 2, 64, 4)  # 4 x 2 bytes aligned
    assert not R.torch_vector_path(10, 4, 0, 0)  # numel % 4
    assert R.recipe_kernel_name(rec("single", "bfloat16"), "bfloat16") == "adamw_torch_ops_bf16_bf16_bf16"
    assert R.recipe_kernel_name(rec("fused", "float16", master=True), "float32") == "adamw_torch_fused_f16_f32_f32"
    assert set(R.recipe_kernel_name(rec(i, d, master=mw), g) for i, d, mw, g in itertools.product(
        R.IMPLS, dk.DTYPES, (False, True), dk.DTYPES)) == set(dk.recipe_kernel_names())


@pytest.mark.parametrize("recipe, match", [
    (R.TorchRecipe("fused", "cpu", "float32"), "platform 'cuda'"),
    (rec("capturable"), "no device kernel for impl"),
    (rec(dtype="float64"), "float64"),
    (rec("foreach", lr_tensor=True), "capturable"),
])
def test_recipes_without_a_device_kernel_are_refused_naming_the_recipe(recipe, match):
    with pytest.raises(NotImplementedError, match=match) as info:
        R.check_recipe(recipe)
    assert "TorchRecipe(" in str(info.value)


def test_state_dtype_and_the_emulation_stores_in_it():
    assert [R.state_dtype(rec(dtype=d, master=m)) for d, m in
            [("float32", False), ("bfloat16", False), ("float16", True), ("float32", True)]] == \
        ["float32", "bfloat16", "float32", "float32"]
    r = rec("fused", "bfloat16", amsgrad=True)
    p = np.array([1.0, -2.0, 3.0], np.float32)
    out = X.recipe_step(r, p, p * 0.1, p * 0.0, p * 0.0, p * 0.0, R.cuda_scalars(r, HP, 1), R.F_DECAY)
    assert all(np.array_equal(X.rnd(a, "bfloat16"), a) for a in out[:4])


def _item(**kw):
    it = dict(param=256, grad=512, master=0, m=1024, v=2048, vmax=0, n=10,
              scalars=np.zeros(R.N_SCALARS, np.float32), flags=0)
    it.update(kw)
    return R.TorchItem(**it)


@pytest.mark.parametrize("recipe, items, match", [
    (rec(), [_item(m=1026)], r"items\[0\]\.m = 0x402 is not 4-byte aligned"),
    (rec(dtype="bfloat16"), [_item(m=1026)], None),  # bf16 state: 2-byte aligned is enough
    (rec(amsgrad=True), [_item()], r"items\[0\]\.vmax is a null pointer"),
    (rec(), [_item(vmax=4096)], "amsgrad recipes only"),
    (rec(dtype="bfloat16", master=True), [_item()], r"items\[0\]\.master is a null pointer"),
    (rec(dtype="bfloat16"), [_item(master=4096)], "no fp32 master"),
    (rec(), [_item(), _item(n=-1)], r"items\[1\]: n must be >= 0"),
    (rec(), [_item(scalars=np.zeros(3, np.float32))], "scalars must have shape"),
    (R.TorchRecipe("fused", "cpu", "float32"), [_item()], "platform"),
])
def test_launch_torch_multi_checks_every_item_before_touching_cuda(recipe, items, match):
    """No CuPy here: a launch would raise ImportError (or a CuPy error), not the ValueError naming the bad item;
    items that pass lead to the launch itself (it fails without CuPy/GPU)."""
    if match is None:
        with pytest.raises((ImportError, RuntimeError, AttributeError, Exception)) as info:
            R.launch_torch_multi(recipe, "bfloat16" if recipe.dtype == "bfloat16" else "float32", items)
        assert not isinstance(info.value, ValueError)
        return
    with pytest.raises((ValueError, NotImplementedError), match=match):
        R.launch_torch_multi(recipe, recipe.dtype, items)
    assert R.launch_torch_multi(rec(), "float32", [_item(n=0, param=0, grad=0, m=0, v=0)]) == 0  # empty: nothing


# -- the placement's recipes (the launcher replaced by a recorder) ---------------------------------------------


class _Backend:
    device_index = 0

    def update_stream(self):
        return 0

    def update_wait(self, event):
        pass

    def record_update(self):
        return None

    def record_compute(self, param):
        return None

    def data_ptr(self, tensor):
        return tensor

    def param_to_host_f32(self, param, out):
        out[:] = 1.5

    def wait_on_compute(self, event, param):
        pass


@pytest.fixture
def placement(monkeypatch):
    """A DevicePlacement (zero-copy) whose launches are recorded: (kernel, [(n, flags, vmax?, master?)])."""
    record, buffers, addresses = [], {}, itertools.count(1 << 20, 1 << 26)

    def alloc_mapped(nbytes, device=None):
        ptr = next(addresses)
        buffers[ptr] = np.zeros(nbytes, np.uint8)
        return ptr, ptr, lambda: None

    def launch(recipe, gd, items, stream=0, *, device=None, max_blocks=None):
        record.append((R.recipe_kernel_name(recipe, gd),
                       [(it.n, it.flags, bool(it.vmax), bool(it.master), float(it.scalars[S["S_GRAD_DIV"]]))
                        for it in items]))
        return len(items)

    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "alloc_mapped", alloc_mapped)
    monkeypatch.setattr(dk, "host_view", lambda ptr, n, dtype=np.float32: buffers[ptr].view(dtype)[:n])
    monkeypatch.setattr(R, "launch_torch_multi", launch)
    eng = ge.DevicePlacement(_Backend())
    eng.staged = False
    yield eng, record
    eng.close()


def test_slots_launch_by_kernel_with_their_flags(placement):
    """Consecutive slots of one kernel share a launch (foreach and single, AdamW and Adam: flags per item); a new
    kernel (dtype, state dtype, fused) or amsgrad starts another."""
    eng, record = placement
    layout = [(rec("foreach"), 4), (rec("single", decoupled=False), 8), (rec("foreach", amsgrad=True), 5),
              (rec("fused", "bfloat16"), 12), (rec("fused", "bfloat16", master=True), 7), (None, 3)]
    sids = [eng.add_param(1000 + 64 * k, n, r.dtype if r else "float32", "cuda", recipe=r)
            for k, (r, n) in enumerate(layout)]
    eng.step([(sid, HP, 5000 + 64 * k, (r.dtype if r else "float32")) for k, (sid, (r, _)) in
              enumerate(zip(sids, layout))], grad_div={sids[3]: 256.0})
    assert [k for k, _ in record] == ["adamw_torch_ops_f32_f32_f32", "adamw_torch_ops_f32_f32_f32",
                                      "adamw_torch_fused_bf16_bf16_bf16", "adamw_torch_fused_bf16_bf16_f32",
                                      "adamw_torch_ops_f32_f32_f32"]
    assert record[0][1] == [(4, R.F_DECAY, False, False, 1.0), (8, R.F_L2 | R.F_SINGLE, False, False, 1.0)]
    assert record[1][1] == [(5, R.F_DECAY, True, False, 1.0)]
    assert record[2][1] == [(12, R.F_DECAY | R.F_GRAD_SCALE | R.F_TORCH_VEC, False, False, 256.0)]
    assert record[3][1] == [(7, R.F_DECAY, False, True, 1.0)]  # master of 7 elements: torch's scalar path
    assert eng.recipe(sids[5]) == rec(master=True)  # None: foreach on an fp32 master
    with pytest.raises(ValueError, match="not fused"):
        eng.step([(sids[0], HP, 5000, "float32")], grad_div={sids[0]: 2.0})


def test_state_bytes_and_dtypes_follow_the_recipe(placement):
    """bf16 weights: 2 + 2 bytes of state per element (torch's scheme), + 2 with amsgrad; a master recipe 4 + 4 + 4;
    state() in the state dtype (uint16 bits), load_state() of bits or values."""
    eng, _ = placement
    a = eng.add_param(1000, 10, "bfloat16", "cuda", recipe=rec("fused", "bfloat16"))
    b = eng.add_param(2000, 10, "bfloat16", "cuda", recipe=rec("foreach", "bfloat16", amsgrad=True))
    c = eng.add_param(3000, 10, "bfloat16", "cuda", recipe=rec("single", "bfloat16", master=True, amsgrad=True))
    assert eng.stats()["host_state_bytes"] == 40 + 60 + 160
    sa, sb, sc = eng.state(a), eng.state(b), eng.state(c)
    assert sorted(sa) == ["exp_avg", "exp_avg_sq", "step"] and sa["exp_avg"].dtype == np.uint16
    assert sorted(sb) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert sc["exp_avg"].dtype == np.float32 and (sc["master"] == 1.5).all()
    vals = np.linspace(-1, 1, 10).astype(np.float32)
    eng.load_state(a, {"step": 3, "exp_avg": C.f32_to_bf16_bits(vals), "exp_avg_sq": vals ** 2})
    sa = eng.state(a)
    assert np.array_equal(sa["exp_avg"], C.f32_to_bf16_bits(vals)) and sa["step"] == 3
    assert np.array_equal(sa["exp_avg_sq"], C.f32_to_bf16_bits(vals ** 2))
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        eng.load_state(b, {"step": 1, "exp_avg": vals, "exp_avg_sq": vals})
    with pytest.raises(NotImplementedError, match="platform 'cuda'"):
        eng.add_param(4000, 10, "float32", "cuda", recipe=R.TorchRecipe("foreach", "cpu", "float32"))
    with pytest.raises(ValueError, match="is for float32 parameters"):
        eng.add_param(4000, 10, "bfloat16", "cuda", recipe=rec())
