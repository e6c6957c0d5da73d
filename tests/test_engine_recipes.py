"""The engine's slots laid out and updated by their recipe (``Engine.add_param(recipe=)``), on the CPU through the
real torch backend: the bits of ``torch.optim.AdamW``/``Adam`` over several steps and chunks, fp16/bf16 state
without a master, the master scheme's fp32 gradient sums, GradScaler's division, the state as dicts, weights
changed outside, and the host bytes each recipe takes (the plan equals the allocation)."""

import numpy as np
import pytest

from trainstream import contract as C
from trainstream.core import _budget as B
from trainstream.core import _engine as E

from _recipes import data, make_opt, nbad, recipe_of, torch_state, values

torch = pytest.importorskip("torch")
from trainstream.backends.torch import TorchBackend, torch_cpu_code  # noqa: E402


def _engine(**kw):
    return E.Engine(TorchBackend(torch.device("cpu")), mode="cpu", threads=2, chunk_size=4096,
                    tc_code=torch_cpu_code(), **kw)


def _twin(cls, dtype, impl, kw, p0, master=False):
    """torch's optimizer on ``p0`` and our slot on a copy of the same weights (the master scheme: torch on fp32
    copies of the master, the slot on the rounded weights)."""
    p, opt = make_opt(cls, "float32" if master else dtype, impl, kw, C.round_to(p0, dtype))
    recipe, hp = recipe_of(opt, impl, master=master)
    recipe = recipe._replace(dtype=dtype, master=master)
    mine = torch.nn.Parameter(torch.from_numpy(C.round_to(p0, dtype)).to(getattr(torch, dtype)))
    return p, opt, recipe, hp, mine


@pytest.mark.parametrize("cls,dtype,impl,kw", [
    ("AdamW", "float32", "single", {}),
    ("AdamW", "bfloat16", "single", {"weight_decay": 0.1}),
    ("Adam", "bfloat16", "foreach", {"weight_decay": 0.1, "amsgrad": True}),
    ("Adam", "float16", "fused", {"weight_decay": 0.1, "maximize": True, "eps": 1e-3}),
    ("AdamW", "bfloat16", "fused", {"lr": 0.01, "amsgrad": True}),
])
def test_slots_update_as_torch(cls, dtype, impl, kw):
    """Two slots (odd sizes: scalar tails, several chunks), a clip multiplier on some steps, the eager path on others."""
    eng = _engine()
    twins, sids = [], []
    for n, seed in ((10007, 0), (63, 1)):
        p0, grads = data(n, 6, seed)
        p, opt, recipe, hp, mine = _twin(cls, dtype, impl, kw, p0)
        sids.append(eng.add_param(mine.data.view(-1), n, dtype, "cpu", recipe=recipe))
        twins.append((p, opt, mine, grads, hp))
    for t in range(6):
        # clip_grad_norm_'s multiplier, cast to the gradient's dtype (the adapter's c)
        clip = float(torch.tensor(0.6).to(getattr(torch, dtype))) if t % 2 else None
        for sid, (p, opt, mine, grads, hp) in zip(sids, twins):
            g = torch.from_numpy(grads[t]).to(p.dtype)
            p.grad = g.clone() if clip is None else g.clone().mul_(torch.tensor(clip).to(g.dtype))
            opt.step()
            eng.offload_grad(sid, g.clone(), dtype, update=hp if t == 4 else None)
        eng.step([(sid, tw[4]) for sid, tw in zip(sids, twins)], coefs={sid: clip for sid in sids} if clip else None)
        eng.synchronize()
        for sid, (p, opt, mine, _, _) in zip(sids, twins):
            want, got = torch_state(p, opt), eng.state(sid)
            sd = C.state_dtype(eng._args[sid][4])
            assert nbad(mine.detach().float().numpy(), want["p"]) == 0, (sid, t)
            for key, wkey in (("exp_avg", "m"), ("exp_avg_sq", "v"), ("max_exp_avg_sq", "vmax")):
                if wkey in want:
                    assert got[key].dtype == (np.float32 if sd == "float32" else np.uint16)
                    assert nbad(values(got[key], sd), want[wkey]) == 0, (sid, key, t)
            assert got["step"] == t + 1 and "master" not in got
    eng.close()


def test_master_sums_micro_batches_in_fp32():
    """``master=True`` bf16: three micro-batches added into the fp32 sum (the first eager-free), clipped in fp32,
    equal torch's fused AdamW on fp32 master copies fed the fp32 sums; one micro-batch with the eager path reads the
    staging directly; ``accumulate`` on a slot without sums is refused."""
    n = 5000
    p0, grads = data(n, 12, 7)
    p, opt, recipe, hp, mine = _twin("AdamW", "bfloat16", "fused", {"weight_decay": 0.1}, p0, master=True)
    eng = _engine()
    sid = eng.add_param(mine.data.view(-1), n, "bfloat16", "cpu", recipe=recipe)
    plain = eng.add_param(torch.zeros(10, dtype=torch.bfloat16).view(-1), 10, "bfloat16", "cpu")  # default: no sums
    with pytest.raises(ValueError, match="keeps no fp32 gradient sum"):
        eng.offload_grad(plain, torch.zeros(10, dtype=torch.bfloat16), "bfloat16", accumulate=True)
    for step in range(3):
        micro = [torch.from_numpy(g).to(torch.bfloat16) for g in grads[4 * step: 4 * step + 3]]
        acc = micro[0].float()
        for g in micro[1:]:
            acc = acc + g.float()
        for g in micro:
            eng.offload_grad(sid, g, "bfloat16", accumulate=True)
        p.grad = acc * torch.tensor(0.5)
        opt.step()
        eng.step([(sid, hp)], coefs={sid: 0.5})
        eng.synchronize()
        st = eng.state(sid)
        want = torch_state(p, opt)
        assert nbad(st["master"], want["p"]) == nbad(st["exp_avg"], want["m"]) == 0, step
        assert nbad(mine.detach().float().numpy(), C.round_to(want["p"], "bfloat16")) == 0
    g = torch.from_numpy(grads[-1]).to(torch.bfloat16)  # one micro-batch, eager: from the bf16 staging
    p.grad = g.float()
    opt.step()
    eng.offload_grad(sid, g, "bfloat16", update=hp, accumulate=True)
    eng.synchronize()
    assert nbad(eng.state(sid)["master"], torch_state(p, opt)["p"]) == 0
    eng.close()


def test_grad_div_reaches_fused_slots_only():
    n = 4099
    p0, grads = data(n, 3, 8)
    p, opt, recipe, hp, mine = _twin("AdamW", "bfloat16", "fused", {"weight_decay": 0.1}, p0)
    eng = _engine()
    sid = eng.add_param(mine.data.view(-1), n, "bfloat16", "cpu", recipe=recipe)
    other = eng.add_param(torch.zeros(8).view(-1), 8, "float32", "cpu")
    for g in grads:
        gt = torch.from_numpy(g).to(torch.bfloat16) * 512
        p.grad = gt.clone()
        opt.grad_scale, opt.found_inf = torch.tensor(512.0), torch.tensor(0.0)
        opt.step()
        eng.offload_grad(sid, gt, "bfloat16")
        eng.step([(sid, hp)], grad_div={sid: 512.0})
        eng.synchronize()
        assert nbad(mine.detach().float().numpy(), torch_state(p, opt)["p"]) == 0
    eng.offload_grad(other, torch.zeros(8), "float32")
    with pytest.raises(ValueError, match="not fused"):
        eng.step([(other, hp)], grad_div={other: 2.0})
    eng.close()


def test_state_dicts_round_trip_and_cast_as_torch_loads():
    """``state()`` keys and dtypes per recipe; ``load_state`` takes them back, casts float arrays to the state dtype
    (as torch's ``load_state_dict`` casts to the parameter's), re-reads the weights, checks ``max_exp_avg_sq``."""
    eng = _engine()
    n = 300
    w = torch.linspace(-1, 1, n).to(torch.bfloat16)
    sid = eng.add_param(w.view(-1), n, "bfloat16", "cpu", recipe=C.TorchRecipe("single", "cpu", "bfloat16",
                                                                               amsgrad=True))
    st = eng.state(sid)
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"] and st["exp_avg"].dtype == np.uint16
    m = np.linspace(0, 1e-3, n, dtype=np.float32)
    eng.load_state(sid, {"step": 3, "exp_avg": m, "exp_avg_sq": m * m, "max_exp_avg_sq": st["max_exp_avg_sq"]})
    got = eng.state(sid)
    assert got["step"] == 3
    assert np.array_equal(got["exp_avg"], torch.from_numpy(m).to(torch.bfloat16).view(torch.int16).numpy().view(
        np.uint16))
    with pytest.raises(ValueError, match="lacks 'max_exp_avg_sq'"):
        eng.load_state(sid, {"step": 3, "exp_avg": m, "exp_avg_sq": m})
    master = eng.add_param(w.view(-1), n, "bfloat16", "cpu", recipe=C.TorchRecipe("fused", "cpu", "bfloat16",
                                                                                  master=True))
    st = eng.state(master, copy=False)
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "master", "step"] and st["master"].dtype == np.float32
    st["master"][:] += 1e-4  # copy=False: the buffers themselves
    assert np.array_equal(eng.state(master)["master"], st["master"])
    eng.load_state(master, {"step": 1, "exp_avg": m, "exp_avg_sq": m})  # no master: re-read from the weights
    assert np.array_equal(eng.state(master)["master"], w.float().numpy())
    eng.close()


def test_weights_changed_outside_are_followed_without_a_master():
    n = 4099
    p0, grads = data(n, 4, 9)
    p, opt, recipe, hp, mine = _twin("AdamW", "bfloat16", "single", {"weight_decay": 0.1}, p0)
    eng = _engine()
    sid = eng.add_param(mine.data.view(-1), n, "bfloat16", "cpu", recipe=recipe)
    for t, g in enumerate(grads):
        if t == 2:  # an in-place edit of both
            with torch.no_grad():
                p.mul_(0.5)
                mine.mul_(0.5)
            eng.reload_param(sid)
        gt = torch.from_numpy(g).to(torch.bfloat16)
        p.grad = gt.clone()
        opt.step()
        eng.offload_grad(sid, gt, "bfloat16")
        eng.step([(sid, hp)])
        eng.synchronize()
        assert nbad(mine.detach().float().numpy(), torch_state(p, opt)["p"]) == 0, t
    eng.close()


@pytest.mark.parametrize("pin_moments", [False, True])
def test_host_bytes_per_recipe_equal_the_allocation(pin_moments):
    """The plan per recipe equals what the slots take; the figures per parameter (pageable, no pinning on the CPU):
    fp32 16 B (+4 amsgrad), bf16 without a master 8 B (+2 amsgrad), bf16 master 18 B with fp32 sums, 14 B without."""
    n = 1 << 12
    cases = [(C.TorchRecipe(), 16), (C.TorchRecipe(amsgrad=True), 20),
             (C.TorchRecipe("fused", "cpu", "bfloat16"), 8), (C.TorchRecipe("single", "cpu", "float16", amsgrad=True), 10),
             (C.TorchRecipe("fused", "cpu", "bfloat16", master=True), 18), (None, 14)]
    for recipe, per in cases:
        dtype = "bfloat16" if recipe is None else recipe.dtype
        eng = _engine(pin_moments=pin_moments)
        eng.add_param(torch.zeros(n, dtype=getattr(torch, dtype)).view(-1), n, dtype, "cpu", recipe=recipe)
        sums = recipe is not None and recipe.master
        plan = B.host_bytes([(n, dtype, "host", recipe and C.check_recipe(recipe), sums)], can_pin=False,
                            pin_moments=pin_moments)
        st = eng.stats()
        assert st["host_state_bytes"] == sum(plan.values()) == per * n, (recipe, st["host_state_bytes"] / n)
        assert st["pinned_state_bytes"] == 0
        eng.close()
    kw = dict(can_pin=True, weights_in_grad_stage=True)  # on CUDA: the weights and staging pinned, the moments not
    plan = B.host_bytes([(n, "bfloat16", "host", C.TorchRecipe("fused", "cuda", "bfloat16"))], **kw)
    assert (plan["state_pageable"], plan["masters_pinned"], plan["staging_pinned"]) == (4 * n, 2 * n, 2 * n)
    assert B.state_bytes(n, "bfloat16", C.TorchRecipe("fused", "cuda", "bfloat16", amsgrad=True)) == 6 * n


def test_device_slots_refuse_recipes_their_kernels_lack():
    """hybrid/gpu placement of a recipe the device placement does not implement: NotImplementedError naming the
    recipe and mode='cpu'; the default recipe is taken."""
    class Dev:
        closed = False

        def add_param(self, *a, **k):
            return 0

        def close(self):
            pass

    eng = E.Engine(TorchBackend(torch.device("cpu")), mode="hybrid", device_elems=100, threads=1, _device=Dev)
    with pytest.raises(NotImplementedError, match="mode='cpu'"):
        eng.add_param(torch.zeros(10).view(-1), 10, "float32", "cuda", recipe=C.TorchRecipe("fused", "cuda"))
    assert eng.add_param(torch.zeros(10).view(-1), 10, "float32", "cuda") == 0
    assert eng.on_device(0)
    assert not eng.on_device(eng.add_param(torch.zeros(1000).view(-1), 1000, "float32", "cuda",
                                           recipe=C.TorchRecipe("fused", "cuda")))  # over the share: on the host
    with pytest.raises(ValueError, match="recipe is for float32 parameters on cuda"):
        eng.add_param(torch.zeros(1000).view(-1), 1000, "bfloat16", "cuda", recipe=C.TorchRecipe("fused", "cuda"))
    eng.close()


def test_host_refuses_cuda_fused_adam_l2_before_anything_changes():
    """CUDA fused Adam-L2 without maximize, amsgrad or GradScaler (position-dependent roundings): the host refuses the
    update (step and the eager path) naming mode='gpu', and the slot is as before; with maximize, a GradScaler scale,
    AdamW's decay or weight_decay 0 it updates."""
    eng = _engine()
    n = 1000
    hp = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.1)
    sid = eng.add_param(torch.zeros(n).view(-1), n, "float32", "cuda",
                        recipe=C.TorchRecipe("fused", "cuda", decoupled=False))
    g = torch.full((n,), 0.5)
    eng.offload_grad(sid, g.clone(), "float32")
    with pytest.raises(NotImplementedError, match="mode='gpu'"):
        eng.step([(sid, hp)])
    with pytest.raises(NotImplementedError, match="mode='gpu'"):
        eng.offload_grad(sid, g.clone(), "float32", update=hp)
    eng.synchronize()
    assert eng.state(sid)["step"] == 0
    eng.step([(sid, hp._replace(weight_decay=0.0))])
    eng.offload_grad(sid, g.clone(), "float32")
    eng.step([(sid, hp)], grad_div={sid: 2.0})
    eng.set_recipe(sid, C.TorchRecipe("fused", "cuda", decoupled=False, maximize=True))
    eng.offload_grad(sid, g.clone(), "float32")
    eng.step([(sid, hp)])
    eng.synchronize()
    assert eng.state(sid)["step"] == 3
    eng.close()
