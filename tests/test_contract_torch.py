"""The torch recipes of the contract (``TorchRecipe``, ``torch_scalars``, ``torch_reference_update``) against the real
``torch.optim.AdamW``/``Adam`` on the CPU, bit for bit, and against the research spec's CUDA lines (an emulation:
no GPU here; the GPU test at the end holds them to torch on CUDA)."""

import itertools

import numpy as np
import pytest

from trainstream import contract as C

from _recipes import data, emulate_cuda, make_opt, nbad, recipe_of, torch_state

torch = pytest.importorskip("torch")

#: (class, keyword arguments): torch's own CPU inputs (common_optimizers) and the research matrix's extras.
CONFIGS = [
    ("AdamW", {}), ("AdamW", {"lr": 0.01, "weight_decay": 0.1}), ("Adam", {"weight_decay": 0.1}),
    ("Adam", {"weight_decay": 0.1, "maximize": True}), ("AdamW", {"weight_decay": 0.1, "amsgrad": True}),
    ("Adam", {"weight_decay": 0.1, "amsgrad": True, "maximize": True}), ("AdamW", {"betas": (0.3, 0.5)}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("AdamW", {"lr": "T", "weight_decay": 0.1}), ("Adam", {"lr": "T", "weight_decay": 0.1, "amsgrad": True}),
]
IMPLS = ["single", "foreach", "fused"]
DTYPES = ["float32", "bfloat16", "float16"]


def _kw(kw, dtype):
    kw = dict(kw)
    if kw.get("lr") == "T":
        kw["lr"] = torch.tensor(0.01)
    if dtype == "float16":
        kw.setdefault("eps", 0.1)  # torch's fp16 inputs: R(1e-8) is 0 in fp16 (test_fp16_default_eps_divides_zero)
    return kw


def _probe():
    from trainstream import _cpu_sqrt as S
    from trainstream.backends.torch import torch_cpu_code

    code = torch_cpu_code()
    return code, (lambda x: S.sqrt_array(x, code & 3)), not code & C.TC_NO_FMA


def _run_against_torch(cls, kw, dtype, impl, n, steps, threads=None, seed=0, grad_scale=None):
    """Mismatching elements of the reference against torch, every step from the reference's own state."""
    code, sqrt, fma = _probe()
    p0, grads = data(n, steps, seed)
    p, opt = make_opt(cls, dtype, impl, _kw(kw, dtype), p0)
    recipe, hp = recipe_of(opt, impl)
    st = {"p": p.detach().float().numpy().copy(), "m": np.zeros(n, np.float32), "v": np.zeros(n, np.float32)}
    if recipe.amsgrad:
        st["vmax"] = np.zeros(n, np.float32)
    for t, g in enumerate(grads, 1):
        gt = torch.from_numpy(g).to(p.dtype)
        p.grad = gt.clone()
        if grad_scale is not None:
            opt.grad_scale, opt.found_inf = torch.tensor(grad_scale), torch.tensor(0.0)
        opt.step()
        s = C.torch_scalars(recipe, hp, t, grad_scale=grad_scale)
        tails = C.torch_cpu_tails(recipe, n, code, threads or torch.get_num_threads())
        st = C.torch_reference_update(recipe, st, gt.float().numpy(), s, sqrt=sqrt, fma=fma,
                                      tail=C.tail_mask(tails, n))
        want = torch_state(p, opt)
        bad = {k: nbad(st[k], want[k]) for k in want}
        if any(bad.values()):
            return f"step {t}: {bad}"
    return "ok"


@pytest.mark.isa
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_reference_matches_torch_cpu(impl, dtype):
    """Every configuration, 10 steps, odd sizes (scalar tails), bit for bit."""
    results = {}
    for (cls, kw), n in itertools.product(CONFIGS, (63, 4099)):
        if impl == "foreach" and kw.get("lr") == "T":
            continue  # torch refuses it (lr as a Tensor with foreach=True)
        results[cls, str(kw), n] = _run_against_torch(cls, kw, dtype, impl, n, 10)
    assert all(r == "ok" for r in results.values()), {k: r for k, r in results.items() if r != "ok"}


@pytest.mark.isa
@pytest.mark.parametrize("threads", [1, 2])
def test_reference_follows_torch_thread_chunks(threads):
    """fp16/bf16 Adam's L2 on 70001 elements (two thread chunks of ATen's parallel_for): the scalar tails of each
    chunk, as ``torch.get_num_threads()`` says at step time; and the fused kernel on a large odd tensor."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {(dtype, impl): _run_against_torch("Adam", {"weight_decay": 0.1}, dtype, impl, 70001, 4)
               for dtype in ("bfloat16", "float16") for impl in ("single", "foreach", "fused")}
    finally:
        torch.set_num_threads(before)
    assert all(r == "ok" for r in got.values()), got


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_grad_scale_matches_torch(dtype):
    """GradScaler's fused path: ``opt.grad_scale`` divides the gradient in the kernel (S_GRAD_DIV)."""
    assert _run_against_torch("AdamW", {"weight_decay": 0.1}, dtype, "fused", 4099, 6, grad_scale=3.0) == "ok"
    assert _run_against_torch("Adam", {"weight_decay": 0.1, "amsgrad": True}, dtype, "fused", 63, 6,
                              grad_scale=1024.0) == "ok"


def test_fp16_default_eps_divides_zero_as_torch():
    """fp16 single/foreach with eps=1e-8: R(eps) == 0, so an element whose gradients were all zero gets 0/0 = NaN,
    in torch and in the contract alike (a hazard the contract names)."""
    recipe = C.TorchRecipe("single", "cpu", "float16")
    s = C.torch_scalars(recipe, C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0), 1)
    assert s[C.S_EPS] == 0
    p0 = np.ones(8, np.float32)
    p, opt = make_opt("AdamW", "float16", "single", {"weight_decay": 0.0}, p0)
    p.grad = torch.zeros(8, dtype=torch.float16)
    opt.step()
    st = C.torch_reference_update(recipe, {"p": p0, "m": np.zeros(8, np.float32), "v": np.zeros(8, np.float32)},
                                  np.zeros(8, np.float32), s)
    assert torch.isnan(p).all() and np.isnan(st["p"]).all()


@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_the_cuda_emulation(impl, dtype):
    """Contract vs emulation (no GPU): the CUDA recipes' reference equals the spec's CUDA lines (restated apart in
    tests/_recipes.py) for every configuration, 10 steps, with and without GradScaler (fused)."""
    n, steps = 4099, 10
    bad = {}
    for (cls, kw), scale in itertools.product(CONFIGS, (None, 4.0)):
        if (scale is not None and impl != "fused") or (kw.get("lr") == "T" and impl == "foreach"):
            continue
        kw = _kw(kw, dtype)
        p0, grads = data(n, steps, 1)
        p, opt = make_opt(cls, dtype, "single", kw, p0)  # (only its resolved arguments are used)
        recipe, hp = recipe_of(opt, impl, "cuda")
        o = dict(lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay,
                 amsgrad=recipe.amsgrad, maximize=recipe.maximize, decoupled=recipe.decoupled,
                 lr_tensor=recipe.lr_tensor, grad_scale=scale)
        st = {"p": C.round_to(p0, dtype), "m": np.zeros(n, np.float32), "v": np.zeros(n, np.float32)}
        if recipe.amsgrad:
            st["vmax"] = np.zeros(n, np.float32)
        for t, g in enumerate(grads, 1):
            g = C.round_to(g, dtype)
            want = emulate_cuda(impl, dtype, o, st, g, t)
            st = C.torch_reference_update(recipe, st, g, C.torch_scalars(recipe, hp, t, grad_scale=scale))
            if n_bad := sum(nbad(st[k], want[k]) for k in want):
                bad[cls, str(kw), scale] = (t, n_bad)
                break
    assert not bad, bad


def test_recipe_resolution_and_checks():
    assert C.resolve_impl("cpu") == "single" and C.resolve_impl("cuda") == "foreach"
    assert C.resolve_impl("cuda", lr_tensor=True) == "single" and C.resolve_impl("cpu", fused=True) == "fused"
    assert C.resolve_impl("cuda", foreach=True) == "foreach" and C.resolve_impl("cuda", foreach=False) == "single"
    with pytest.raises(RuntimeError, match="cannot be `True` together"):
        C.resolve_impl("cuda", fused=True, foreach=True)
    assert C.default_recipe("cpu", "bfloat16") == C.TorchRecipe("single", "cpu", "bfloat16", master=True)
    assert C.check_recipe(C.TorchRecipe(master=True)).master is False  # float32: the same layout either way
    assert [C.state_dtype(C.TorchRecipe(dtype=d)) for d in DTYPES] == DTYPES
    assert C.state_dtype(C.TorchRecipe(dtype="bfloat16", master=True)) == "float32"
    for bad, match in ((C.TorchRecipe(impl="capturable"), "impl"), (C.TorchRecipe(platform="xla"), "platform"),
                       (C.TorchRecipe(dtype="float64"), "dtype"), (C.TorchRecipe("foreach", lr_tensor=True), "Tensor lr")):
        with pytest.raises(ValueError, match=match):
            C.check_recipe(bad)


def test_scalars_as_torch_forms_them():
    """A few values that differ between the recipes, written out."""
    hp = C.AdamWHyperParams(0.01, 0.9, 0.999, 1e-8, 0.1)
    f32, r16 = np.float32, lambda x: np.float32(np.float16(np.float32(x)))
    s = C.torch_scalars(C.TorchRecipe("foreach", "cpu", "float16", decoupled=False, maximize=True), hp, 3, 0.5)
    assert s[C.S_CLIP] == -0.5 and s[C.S_L2] == r16(0.1) and s[C.S_DECAY] == 1 and s[C.S_BETA2] == r16(0.999)
    assert s[C.S_EPS] == 0 and s[C.S_GRAD_DIV] == 1
    s = C.torch_scalars(C.TorchRecipe("single", "cuda", "float32"), hp, 3)
    assert s[C.S_INV_SQRT_BC2] == f32(1.0 / (1 - 0.999**3) ** 0.5) and s[C.S_DECAY] == f32(1 - 0.01 * 0.1)
    s = C.torch_scalars(C.TorchRecipe("fused", "cuda", "bfloat16"), hp, 3, bias=(f32(0.25), f32(0.5)))
    assert s[C.S_NEG_STEP] == -(f32(0.01) / f32(0.25)) and s[C.S_SQRT_BC2] == f32(np.sqrt(f32(0.5)))
    assert s[C.S_NEG_LR_WD] == -(f32(0.01) * f32(0.1)) and s[C.S_BETA1] == f32(0.9) and s[C.S_L2] == 0
    s = C.torch_scalars(C.TorchRecipe(lr_tensor=True), hp, 3)  # float32 tensor arithmetic
    assert s[C.S_DECAY] == f32(1) - f32(0.01) * f32(0.1) and s[C.S_NEG_STEP] == -(f32(0.01) / f32(1 - 0.9**3))
    assert C.torch_scalars(C.TorchRecipe(), hp, C.TORCH_MAX_STEP + 5)[C.S_NEG_STEP] == \
        C.torch_scalars(C.TorchRecipe(), hp, C.TORCH_MAX_STEP)[C.S_NEG_STEP]  # torch's float32 step stops at 2**24
    assert C.torch_step_scalars(hp, 3)[C.S_NEG_STEP] == f32(-(0.01 / (1 - 0.9**3)))


def test_cpu_tails():
    bf_l2 = C.TorchRecipe("single", "cpu", "bfloat16", decoupled=False)
    assert C.torch_cpu_tails(bf_l2, 100, 0) == ((96, 100),)
    assert C.torch_cpu_tails(bf_l2, 100, C.TC_VEC512) == ((64, 100),)
    assert C.torch_cpu_tails(bf_l2, 100, C.TC_NO_FMA) == ((0, 100),)
    assert C.torch_cpu_tails(bf_l2, 70001, 0, 2) == ((34976, 35001), (69977, 70001))
    assert C.torch_cpu_tails(bf_l2, 70001, 0, 1) == ((69984, 70001),)
    assert C.tails_follow_threads(bf_l2, 0) and not C.tails_follow_threads(bf_l2, C.TC_NO_FMA)
    assert C.torch_cpu_tails(bf_l2._replace(decoupled=True), 100, 0) == ()
    assert C.torch_cpu_tails(C.TorchRecipe("fused", "cpu", "float32"), 100, 0) == ((96, 100),)
    assert C.torch_cpu_tails(C.TorchRecipe("fused", "cpu", "float16"), 100, C.TC_VEC512) == ((96, 100),)
    assert C.torch_cpu_tails(C.TorchRecipe("fused", "cpu", "bfloat16", master=True), 100, 0) == ((96, 100),)
    assert C.torch_cpu_tails(C.TorchRecipe("fused", "cuda", "float16"), 100, 0) == ()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_torch_on_cuda(impl, dtype):
    """On a GPU: the CUDA recipes' reference (fused's bias corrections by the device's powf) against torch on CUDA,
    every configuration, 10 steps, bit for bit; fused Adam-L2 without maximize, amsgrad or GradScaler is left out
    (positional roundings the reference does not reproduce and the host refuses: the contract says so)."""
    from trainstream.backends.torch import TorchBackend

    dev = torch.device("cuda")
    pw = TorchBackend(dev).device_pow
    n, steps, bad = 4099, 10, {}
    for cls, kw in CONFIGS:
        if kw.get("lr") == "T" and impl == "foreach":
            continue
        if impl == "fused" and cls == "Adam" and kw.get("weight_decay") and not kw.get("maximize") \
                and not kw.get("amsgrad") and not kw.get("decoupled_weight_decay"):
            continue
        p0, grads = data(n, steps, 2)
        p, opt = make_opt(cls, dtype, impl, _kw(kw, dtype), p0, "cuda")
        recipe, hp = recipe_of(opt, impl, "cuda")
        for t, g in enumerate(grads, 1):
            st = torch_state(p, opt) if t > 1 else {"p": C.round_to(p0, dtype), "m": np.zeros(n, np.float32),
                                                   "v": np.zeros(n, np.float32), "vmax": np.zeros(n, np.float32)}
            gt = torch.from_numpy(g).to(dev, p.dtype)
            p.grad = gt.clone()
            opt.step()
            bias = tuple(np.float32(1) - pw(b, t, 1)[0] for b in (hp.beta1, hp.beta2))
            want = C.torch_reference_update(recipe, st, gt.float().cpu().numpy(),
                                            C.torch_scalars(recipe, hp, t, bias=bias))
            got = torch_state(p, opt)
            if n_bad := sum(nbad(got[k], want[k]) for k in got):
                bad[cls, str(kw)] = (t, n_bad)
                break
    assert not bad, bad
