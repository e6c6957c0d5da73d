"""The host kernel of every torch recipe (``trainstream._host_kernels.adamw_chunk(..., recipe)``): against the real
``torch.optim.AdamW``/``Adam`` on the CPU bit for bit (the CPU recipes, the master scheme against torch on fp32
master copies), and against the contract's reference for the CUDA recipes (whose reference the contract tests hold
to the spec's emulation here, and to torch on a GPU). Each test compiles only the specialisations it checks."""

import numpy as np
import pytest

from trainstream import _host_kernels as K
from trainstream import contract as C

from _recipes import HostSlot, bits, data, make_opt, nbad, recipe_of, torch_state, values

torch = pytest.importorskip("torch")

CONFIGS = [
    ("AdamW", {}), ("Adam", {"weight_decay": 0.1}), ("Adam", {"weight_decay": 0.1, "maximize": True}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}), ("AdamW", {"betas": (0.3, 0.5)}),
    ("AdamW", {"lr": "T", "weight_decay": 0.1}), ("Adam", {"weight_decay": 0.1, "amsgrad": True, "maximize": True}),
]


def _kw(kw, dtype):
    kw = dict(kw)
    if kw.get("lr") == "T":
        kw["lr"] = torch.tensor(0.01)
    if dtype == "float16":
        kw.setdefault("eps", 0.1)
    return kw


def _code():
    from trainstream.backends.torch import torch_cpu_code

    return torch_cpu_code()


def _uneven(n, seed):
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, 5)]))
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def _against_torch(cls, kw, dtype, impl, n, steps, threads=1, chunked=False, seed=0, grad_scale=None):
    code = _code()
    p0, grads = data(n, steps, seed)
    p, opt = make_opt(cls, dtype, impl, _kw(kw, dtype), p0)
    recipe, hp = recipe_of(opt, impl)
    slot = HostSlot(recipe, p0, code)
    for t, g in enumerate(grads, 1):
        gt = torch.from_numpy(g).to(p.dtype)
        p.grad = gt.clone()
        if grad_scale is not None:
            opt.grad_scale, opt.found_inf = torch.tensor(grad_scale), torch.tensor(0.0)
        opt.step()
        s = C.torch_scalars(recipe, hp, t, grad_scale=grad_scale)
        slot.step(bits(gt.float().numpy(), dtype), dtype, s, threads, _uneven(n, t) if chunked else None)
        got, want = slot.state(), torch_state(p, opt)
        if bad := {k: nbad(got[k], want[k]) for k in want if nbad(got[k], want[k])}:
            return f"step {t}: {bad}"
    return "ok"


@pytest.mark.isa
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_kernel_matches_torch_cpu(impl, dtype):
    """Every configuration (L2 and decoupled, maximize, amsgrad, Tensor lr, a lerp weight >= 0.5), 10 steps, odd sizes
    (the scalar tails), one chunk and uneven chunks (the tails cut across them)."""
    results = {}
    for cls, kw in CONFIGS:
        if impl == "foreach" and kw.get("lr") == "T":
            continue
        for n, chunked in ((63, False), (4099, True)):
            results[cls, str(kw), n] = _against_torch(cls, kw, dtype, impl, n, 10, chunked=chunked)
    assert all(r == "ok" for r in results.values()), {k: r for k, r in results.items() if r != "ok"}


@pytest.mark.isa
def test_kernel_follows_torch_thread_chunks():
    """fp16/bf16 Adam-L2 on 70001 elements with torch's 1 and 2 threads (each thread chunk's scalar tail), the
    updates in uneven chunks; the fused kernel's tail too."""
    before = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for dtype in ("bfloat16", "float16"):
                for impl in ("single", "fused"):
                    got[threads, dtype, impl] = _against_torch("Adam", {"weight_decay": 0.1}, dtype, impl, 70001, 3,
                                                               threads=threads, chunked=True)
    finally:
        torch.set_num_threads(before)
    assert all(r == "ok" for r in got.values()), got


def test_fused_kernel_divides_by_the_grad_scale():
    assert _against_torch("AdamW", {"weight_decay": 0.1}, "bfloat16", "fused", 4099, 5, grad_scale=3.0) == "ok"
    assert _against_torch("Adam", {"weight_decay": 0.1}, "float32", "fused", 4099, 5, grad_scale=65536.0) == "ok"


@pytest.mark.parametrize("impl", ["single", "fused"])
def test_master_recipe_is_torch_on_fp32_master_copies(impl):
    """``master=True``: torch's optimizer (same implementation) on fp32 copies of the master, with the bf16 gradient
    (clip multiplier rounded to bf16) or the fp32 sum of micro-batches; the weights are ``r(master)`` in bf16."""
    code, n, steps = _code(), 4099, 8
    p0, grads = data(n, steps, 3)
    p0 = C.round_to(p0, "bfloat16")
    for summed in (False, True):
        p, opt = make_opt("Adam", "float32", impl, {"weight_decay": 0.1, "amsgrad": True}, p0)
        recipe, hp = recipe_of(opt, impl, master=True)
        recipe = recipe._replace(dtype="bfloat16", master=True)
        master, m, v, vmax = p0.copy(), *(np.zeros(n, np.float32) for _ in range(3))
        out = np.zeros(n, np.uint16)
        for t, g in enumerate(grads, 1):
            gb = C.round_to(g, "bfloat16")
            clip = np.float32(0.75)
            if summed:  # two micro-batches summed in fp32, the multiplier applied in fp32
                acc = np.zeros(n, np.float32)
                K.accumulate_chunk(acc, bits(gb, "bfloat16"), K.KIND_BF16, 0, n, True)
                K.accumulate_chunk(acc, bits(gb * 0.5, "bfloat16"), K.KIND_BF16, 0, n, False)
                assert np.array_equal(acc, gb + C.round_to(gb * 0.5, "bfloat16"))
                gin, gkind, want_g = acc, K.KIND_F32, acc * clip
            else:  # clip_grad_norm_ on the bf16 gradient: r(g * c)
                gin, gkind, want_g = bits(gb, "bfloat16"), K.KIND_BF16, C.round_to(gb * clip, "bfloat16")
            p.grad = torch.from_numpy(want_g.astype(np.float32))
            opt.step()
            s = C.torch_scalars(recipe, hp, t, clip)
            K.adamw_chunk(0, master, m, v, gin, gkind, out, K.KIND_BF16, 0, n, s, code, recipe=recipe, vmax=vmax,
                          tails=C.torch_cpu_tails(recipe, n, code))
            want = torch_state(p, opt)
            assert nbad(master, want["p"]) == nbad(m, want["m"]) == nbad(vmax, want["vmax"]) == 0, (summed, t)
            assert np.array_equal(out, bits(want["p"], "bfloat16")), (summed, t)


@pytest.mark.parametrize("impl", ["foreach", "single", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_recipes_match_the_contract(impl, dtype):
    """The CUDA recipes' host kernels (``mode="cpu"`` on CUDA parameters) against the contract's reference, bit for
    bit: L2 and decoupled, maximize, amsgrad, a Tensor lr, GradScaler (fused), 10 steps, uneven chunks."""
    n, steps = 4099, 10
    for (cls, kw), scale in ((CONFIGS[1], None), (CONFIGS[2], 8.0), (CONFIGS[2], None), (CONFIGS[3], None),
                             (CONFIGS[5], None)):
        if impl == "foreach" and kw.get("lr") == "T" or scale is not None and impl != "fused":
            continue
        p0, grads = data(n, steps, 4)
        _, opt = make_opt(cls, dtype, "single", _kw(kw, dtype), p0)
        recipe, hp = recipe_of(opt, impl, "cuda")
        slot = HostSlot(recipe, p0)
        st = {"p": C.round_to(p0, dtype), "m": np.zeros(n, np.float32), "v": np.zeros(n, np.float32),
              "vmax": np.zeros(n, np.float32)}
        for t, g in enumerate(grads, 1):
            g = C.round_to(g, dtype)
            s = C.torch_scalars(recipe, hp, t, np.float32(0.5) if t % 3 == 0 else 1.0, grad_scale=scale)
            st = C.torch_reference_update(recipe, st, g, s)
            slot.step(bits(g, dtype), dtype, s, chunks=_uneven(n, t))
            got = slot.state()
            assert all(nbad(got[k], st[k]) == 0 for k in got), (cls, kw, t)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_fused_l2_with_maximize_is_the_device_kernels(dtype):
    """CUDA fused Adam-L2 with maximize rounds ``g + p*wd`` twice at every element: the contract's reference (which
    the host kernels follow) against the emulation of the device kernels that replays the H100 log; without maximize
    the two differ at torch's positional elements, and the engine refuses that update on the host."""
    from _cuda_recipes_ref import recipe_step  # noqa: PLC0415

    from trainstream import _device_recipes as DR  # noqa: PLC0415
    n = 4099
    rng = np.random.default_rng(3)
    p = C.round_to(rng.standard_normal(n).astype(np.float32), dtype)
    g = C.round_to(rng.standard_normal(n).astype(np.float32) * 1e-3, dtype)
    hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.1)
    for maximize in (True, False):
        recipe = C.TorchRecipe("fused", "cuda", dtype, maximize=maximize, decoupled=False)
        s = DR.cuda_scalars(recipe, hp, 1)
        z = np.zeros(n, np.float32)
        want = C.torch_reference_update(recipe, {"p": p, "m": z, "v": z}, g, s)
        got = recipe_step(recipe, p, g, z, z, None, s, DR.recipe_flags(recipe, hp), grad_dtype=dtype)
        differ = sum(int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
                     for a, b in ((got[1], want["m"]), (got[2], want["v"])))
        assert differ == 0 if maximize else differ > 0 or dtype != "float32", (maximize, differ)  # (bf16: rounded)


def test_accumulate_kernel_sums_in_fp32():
    rng = np.random.default_rng(0)
    n = 10007
    for kind, dt in ((K.KIND_F16, "float16"), (K.KIND_BF16, "bfloat16"), (K.KIND_F32, "float32")):
        gs = [C.round_to(rng.standard_normal(n).astype(np.float32) * 10.0 ** rng.uniform(-3, 1), dt) for _ in range(4)]
        acc = np.full(n, np.nan, np.float32)  # a fresh sum ignores what the buffer held
        want = np.zeros(n, np.float32)
        for k, g in enumerate(gs):
            for b, e in _uneven(n, k):
                K.accumulate_chunk(acc, bits(g, dt), kind, b, e, k == 0)
            want = g.copy() if k == 0 else (want + g).astype(np.float32)
            assert nbad(acc, want) == 0, (dt, k)
    z = np.array([-0.0], np.float32)  # the first micro-batch is copied: -0 stays -0
    acc = np.ones(1, np.float32)
    K.accumulate_chunk(acc, z, K.KIND_F32, 0, 1, True)
    assert acc.view(np.uint32)[0] == z.view(np.uint32)[0]


def test_no_master_weights_round_trip_values():
    """fp16/bf16 without a master: the weights' bits are the state (``values``/``bits`` agree with torch's casts)."""
    x = np.array([1.0, 1e-8, 65504.0, 1e5, -3.3], np.float32)
    for dt, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        want = torch.from_numpy(x).to(tdt).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bits(x, dt), want) and np.array_equal(values(want, dt),
                                                                      torch.from_numpy(x).to(tdt).float().numpy())
