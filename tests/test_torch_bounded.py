"""Bounded staging (``OffloadAdamW(bounded_staging=True)``, :mod:`trainstream.core._stream`): bit for bit against
torch.optim.AdamW in the loops users run (plain, ``last_micro_batch()``, micro-batch accumulation, clipping,
GradScaler), the refusals where an update started from a hook cannot follow, the host bytes it plans equal to what it
allocates, and ``host_memory_plan(options=True)``. CPU, small models, several chunks per tensor; the CUDA loop (its
pinned ring, the chunk copies on the side streams) carries the ``gpu`` mark.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import trainstream.core._host as H  # noqa: E402
from trainstream.core import _budget  # noqa: E402
from trainstream.torch import OffloadAdamW  # noqa: E402

CHUNK = 4096  # the smallest chunk: the 96 x 96 weight spans three


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(H, "CHUNK_SIZE", CHUNK)


def mlp(dtype, device="cpu", seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(),
                         nn.Linear(96, 4)).to(device=device, dtype=dtype)


def loss_fn(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def data(n, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=g).to(device) for _ in range(n)]


def same(ref, ours, ropt, opt):
    """Weights and state equal, bit for bit."""
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), f"{name} differs"
        for key, val in ropt.state[p].items():
            assert torch.equal(torch.as_tensor(val).cpu(), torch.as_tensor(opt.state[q][key]).cpu()), (name, key)


def run(flow, dtype, device="cpu", steps=3, **kw):
    """``steps`` steps of loop ``flow`` with torch.optim.AdamW and with OffloadAdamW(bounded_staging=True)."""
    ref, ours = mlp(dtype, device), mlp(dtype, device)
    hyper = dict(lr=1e-2, weight_decay=0.1, **kw)
    ropt = torch.optim.AdamW(ref.parameters(), **hyper)
    opt = OffloadAdamW(ours.parameters(), **hyper, threads=2, bounded_staging=True,
                       max_grad_norm=0.05 if flow == "max_grad_norm" else None)
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=2) for _ in range(2)]
    for i, x in enumerate(data(steps * 2, device)[::2]):
        for m, o, sc in ((ref, ropt, scalers[0]), (ours, opt, scalers[1])):
            last = o.last_micro_batch() if o is opt and flow in ("last_micro_batch", "accumulate") else None
            if flow == "accumulate":
                loss_fn(m, x.flip(0) * 0.5).backward()
            loss = loss_fn(m, x)
            if flow == "scaler":
                loss = sc.scale(loss)
            if last is not None:
                with last:
                    loss.backward()
            else:
                loss.backward()
            if flow == "clip" or (flow == "max_grad_norm" and o is ropt):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            if flow == "scaler":
                sc.step(o)
                sc.update()
            else:
                o.step()
            o.zero_grad()
        same(ref, ours, ropt, opt)
    return opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("flow", ["plain", "last_micro_batch", "accumulate", "max_grad_norm", "clip"])
def test_bounded_staging_is_torch_bit_for_bit(flow, dtype):
    """Each loop, bit for bit; the updates run from the hooks under last_micro_batch() (eager_updates), else at
    step(); nothing is staged per parameter (host bytes: the moments and the ring)."""
    opt = run(flow, dtype)
    st, n = opt.stats(), 6
    assert st["streamed_params"] == n
    assert st["eager_updates"] == (3 * n if flow in ("last_micro_batch", "accumulate") else 0)
    assert st["spec_updates"] == 0
    moments = 2 * (2 if dtype == torch.bfloat16 else 4) * sum(p.numel() for p in mlp(dtype).parameters())
    assert st["host_state_bytes"] == moments + st["stream_ring_bytes"] == st["host_plan_needed"]
    assert st["stream_ring_bytes"] == _budget.stream_ring_bytes(2, CHUNK)
    opt.close()


@pytest.mark.parametrize("kw", [dict(fused=True), dict(amsgrad=True), dict(foreach=False, maximize=True)],
                         ids=["fused", "amsgrad", "for-loop-maximize"])
def test_bounded_staging_recipes(kw):
    """Other recipes (fused's tails, amsgrad's third buffer) through the ring, from the hooks."""
    run("last_micro_batch", torch.bfloat16, **kw).close()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_bounded_staging_with_grad_scaler(fused):
    """GradScaler inside step(): param.grad unscaled in place (foreach) or the kernel divides (fused)."""
    run("scaler", torch.float32, steps=4, fused=fused).close()


def test_what_cannot_follow_an_update_started_from_a_hook():
    """After a last_micro_batch() backward the updates ran from the gradients as they were: clipping them then, a
    second backward in the block, mode='gpu' and speculate=True are refused with the reason (master_weights' refusals:
    test_master_bounded_refusals_change_nothing)."""
    ours = mlp(torch.bfloat16)
    opt = OffloadAdamW(ours.parameters(), threads=2, bounded_staging=True)
    x = data(1)[0]
    with opt.last_micro_batch():
        loss_fn(ours, x).backward()
    with pytest.raises(RuntimeError, match="bounded_staging=True"):
        opt.clip_grad_norm(1.0)
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="not speculative"):
        opt.step()
    opt.close()
    opt = OffloadAdamW(ours.parameters(), threads=2, bounded_staging=True)
    with pytest.raises(RuntimeError, match="second backward"):
        with opt.last_micro_batch():
            loss_fn(ours, x).backward(retain_graph=True)
            loss_fn(ours, x).backward()
    opt.close()
    with pytest.raises(ValueError, match="mode='gpu' stages nothing"):
        OffloadAdamW(ours.parameters(), bounded_staging=True, mode="gpu")
    with pytest.raises(ValueError, match="speculate=True"):
        OffloadAdamW(ours.parameters(), bounded_staging=True, speculate=True)
    with pytest.raises(ValueError, match="bounded_staging"):
        OffloadAdamW(ours.parameters(), bounded_staging=1)


def test_checkpoints_and_copies_of_a_bounded_optimizer():
    """state_dict() into torch.optim.AdamW and back, and copy.deepcopy: the training goes on bit for bit."""
    import copy

    ref, ours = mlp(torch.bfloat16), mlp(torch.bfloat16)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, threads=2, bounded_staging=True)
    for i, x in enumerate(data(4)):
        for m, o in ((ref, ropt), (ours, opt)):
            loss_fn(m, x).backward()
            o.step()
            o.zero_grad()
        if i == 1:
            ropt.load_state_dict(copy.deepcopy(opt.state_dict()))
            twin = copy.deepcopy(opt)
            assert twin.stats()["streamed_params"] == 6
            twin.close()
        same(ref, ours, ropt, opt)
    opt.close()


@pytest.mark.parametrize("bounded,threads,master", [(False, 2, False), (True, 2, False), (True, None, False),
                                                    (False, 2, True), (True, 2, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_plan_is_what_is_allocated(dtype, bounded, threads, master):
    """host_memory_plan before construction == the plan checked at construction == stats() after steps (the ring
    sized by the workers the optimizer starts: ``threads``, or by default), master_weights too."""
    ours = mlp(dtype)
    plan = OffloadAdamW.host_memory_plan(ours.parameters(), bounded_staging=bounded, threads=threads,
                                         master_weights=master)
    opt = OffloadAdamW(ours.parameters(), threads=threads, bounded_staging=bounded, master_weights=master)
    for x in data(2):
        loss_fn(ours, x).backward()
        opt.step()
        opt.zero_grad()
    st = opt.stats()
    assert plan["needed"] == st["host_plan_needed"] == st["host_state_bytes"]
    numel = sum(p.numel() for p in ours.parameters())
    sums = 4 * numel if master and dtype == torch.bfloat16 else 0  # the master scheme's fp32 gradient sums
    assert plan["staging_pageable"] == (st["stream_ring_bytes"] if bounded else
                                        sum(p.numel() * p.element_size() for p in ours.parameters()) + sums)
    if bounded and master and dtype == torch.bfloat16:  # fp32 master and moments, the ring
        assert plan["needed"] == 12 * numel + st["stream_ring_bytes"]
    opt.close()


def _gpt_shape(layers, d, vocab=50304, ctx=1024, dtype=torch.bfloat16):
    """The parameters of experiments/models_torch.GPT(layers, d, ...) on the meta device (nothing allocated)."""
    shapes = [(vocab, d), (ctx, d)] + [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d),
                                        (4 * d,), (d, 4 * d), (d,)] * layers + [(d,), (d,)]
    return [nn.Parameter(torch.empty(s, dtype=dtype, device="meta")) for s in shapes]


def test_options_name_what_fits_and_how_far_the_model_grows():
    """options=True on a 7B bf16 GPT shape (meta tensors) for a 64 GiB host: bytes per parameter of each setup,
    which fit, the largest model each allows (the ring a constant), and the first that fits."""
    params = _gpt_shape(32, 4096)
    n = sum(p.numel() for p in params)
    assert 6.6e9 < n < 6.7e9
    gib = 1 << 30
    plan = OffloadAdamW.host_memory_plan(params, host_memory=64 * gib, threads=7, options=True)
    assert plan["available"] == 64 * gib and plan["usable"] == int(64 * gib * 0.9)
    rows = {(r["master_weights"], r["mode"], r["bounded_staging"]): r for r in plan["options"]}
    per = {k: r["bytes_per_param"] for k, r in rows.items()}
    assert per[(False, "cpu", True)] == 4.0  # the moments alone
    assert per[(False, "cpu", False)] == 8.0  # + the weights' host copy and the gradient staging
    assert per[(False, "gpu", False)] == 4.0
    assert per[(True, "cpu", False)] == 18.0  # fp32 master and moments, the staging, the fp32 gradient sums
    assert per[(True, "cpu", True)] == per[(True, "hybrid", True)] == 12.0  # bounded: fp32 master and moments
    assert per[(True, "gpu", False)] == 12.0
    assert 4.0 < per[(False, "hybrid", False)] < 8.0
    usable = plan["usable"]
    ring = _budget.stream_ring_bytes(7, H.CHUNK_SIZE)
    assert rows[(False, "cpu", True)]["fixed_bytes"] == ring
    assert rows[(False, "cpu", True)]["max_params"] == (usable - ring) // 4
    assert rows[(True, "cpu", False)]["max_params"] == usable // 18
    assert rows[(True, "cpu", True)]["fixed_bytes"] == ring
    assert rows[(True, "cpu", True)]["max_params"] == (usable - ring) // 12
    fits = {k for k, r in rows.items() if r["fits"]}
    assert fits == {(False, "cpu", True), (False, "cpu", False), (False, "hybrid", True), (False, "hybrid", False),
                    (False, "gpu", False)}  # 12 B x 6.65B > 57.6 GiB; 8 B x 6.65B < 57.6 GiB
    assert plan["fitting"] == rows[(False, "cpu", True)]
    small = OffloadAdamW.host_memory_plan(params, host_memory=16 * gib, threads=7, options=True)
    assert small["fitting"] is None and not small["fits"]
    resident = OffloadAdamW.host_memory_plan(params, host_memory=16 * gib, threads=7, options=True,
                                             gpu_state_bytes=8 * gib)
    r = next(r for r in resident["options"] if (r["master_weights"], r["mode"], r["bounded_staging"])
             == (False, "cpu", True))
    assert r["max_params"] == (resident["usable"] - ring) // 4 + 8 * gib // 4  # resident state: 4 B per parameter
    with pytest.raises(ValueError, match="host_memory"):
        OffloadAdamW.host_memory_plan(params, host_memory=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cpu", "hybrid"])
@pytest.mark.parametrize("flow", ["plain", "last_micro_batch", "accumulate", "max_grad_norm", "clip"])
def test_bounded_staging_on_cuda(flow, mode, monkeypatch):
    """The CUDA path: the pinned ring, the chunk copies on the side streams, hybrid's host share streamed."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    ref, ours = mlp(torch.bfloat16, "cuda"), mlp(torch.bfloat16, "cuda")
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, threads=2, bounded_staging=True, mode=mode,
                       **({"gpu_share": 0.5} if mode == "hybrid" else {}),
                       max_grad_norm=0.05 if flow == "max_grad_norm" else None)
    for x in data(4, "cuda"):
        for m, o in ((ref, ropt), (ours, opt)):
            last = o.last_micro_batch() if o is opt and flow in ("last_micro_batch", "accumulate") else None
            if flow == "accumulate":
                loss_fn(m, x * 0.5).backward()
            if last is not None:
                with last:
                    loss_fn(m, x).backward()
            else:
                loss_fn(m, x).backward()
            if flow == "clip" or (flow == "max_grad_norm" and o is ropt):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            o.zero_grad()
        same(ref, ours, ropt, opt)
    st = opt.stats()
    assert st["pinned_state_bytes"] >= st["stream_ring_bytes"] > 0
    assert st["host_state_bytes"] == st["host_plan_needed"]
    opt.close()


@pytest.mark.parametrize("master,impl,decoupled", [(False, "foreach", True), (True, "foreach", True),
                                                   (False, "fused", True), (False, "foreach", False)],
                         ids=["torch-state", "master", "fused", "adam-l2"])
def test_engine_streamed_slot_equals_the_staged_one(master, impl, decoupled):
    """The engine's streamed slot updates as a staged slot does, bit for bit: torch's CPU scalar tails (fused's last
    elements, Adam-L2's per-thread ones) placed by the tensor's position across the ring's chunks, and a master
    kept with the rounded weights uploaded from the ring (the adapter's master_weights with bounded staging, whose
    reference is a slot with fp32 gradient sums: test_master_bounded_is_the_master_scheme_bit_for_bit)."""
    import numpy as np

    from trainstream import contract as C
    from trainstream.backends.torch import TorchBackend
    from trainstream.core import Engine

    torch.manual_seed(3)
    n = 9 * CHUNK + 77  # above ATen's grain: Adam-L2's per-thread tails mid-tensor
    w0 = torch.randn(n).to(torch.bfloat16)
    recipe = C.TorchRecipe(impl=impl, platform="cpu", dtype="bfloat16", master=master, decoupled=decoupled)
    hp = C.validate_hyperparams(1e-2, (0.9, 0.999), 1e-8, 0.1)
    params, engines = [w0.clone(), w0.clone()], []
    for p, streamed in zip(params, (False, True)):
        eng = Engine(TorchBackend(torch.device("cpu")), threads=2)
        eng.add_param(p, n, "bfloat16", "cpu", recipe=recipe, grad_sums=False, streamed=streamed)
        engines.append(eng)
    for _ in range(3):
        g = torch.randn(n).to(torch.bfloat16)
        engines[0].offload_grad(0, g, "bfloat16")
        engines[0].step([(0, hp)])
        engines[1].step([(0, hp, g, "bfloat16")])
        for eng in engines:
            eng.synchronize()
        assert torch.equal(params[0], params[1])
        a, b = (eng.state(0) for eng in engines)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a if k != "step")
    assert engines[1].stats()["host_state_bytes"] == (12 if master else 4) * n + _budget.stream_ring_bytes(2, CHUNK)
    for eng in engines:
        eng.close()


# -- master_weights=True with bounded staging: the master scheme's bits, one backward per step --------------------


def snapshot(model, opt):
    """The weights, the gradients and the optimizer's state, copied (a refusal must leave them as they were)."""
    params = list(model.parameters())
    return ([p.detach().clone() for p in params], [None if p.grad is None else p.grad.clone() for p in params],
            [{k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()} for p in params])


def unchanged(before, model, opt, grads=True):
    """The weights and state (``grads``: and param.grad) are ``before``'s."""
    weights, grad, states = before
    now = snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, now[0])), "weights changed"
    assert not grads or all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grad, now[1])), "grad"
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(states, now[2]))


def run_master(flow, dtype, device="cpu", steps=3, **kw):
    """``steps`` steps of ``flow`` with OffloadAdamW(master_weights=True) (the reference: its fp32 gradient sums on
    the host) and the same with bounded_staging=True, compared bit for bit (weights and state, master_param too)."""
    ref, ours = mlp(dtype, device), mlp(dtype, device)
    hyper = dict(lr=1e-2, weight_decay=0.1, master_weights=True, threads=2, **kw)
    ropt = OffloadAdamW(ref.parameters(), **hyper)
    opt = OffloadAdamW(ours.parameters(), **hyper, bounded_staging=True)
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=2) for _ in range(2)]
    for x in data(steps * 2, device)[::2]:
        for m, o, sc in ((ref, ropt, scalers[0]), (ours, opt, scalers[1])):
            loss = loss_fn(m, x)
            if flow.startswith("scaler"):
                loss = sc.scale(loss)
            if flow == "last_micro_batch":
                with o.last_micro_batch():
                    loss.backward()
            else:
                loss.backward()
            if flow == "scaler_unscale":  # the user unscales param.grad, then clips it
                sc.unscale_(o)
            if flow in ("clip", "scaler_unscale"):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            if flow.startswith("scaler"):
                sc.step(o)
                sc.update()
            else:
                o.step()
            if flow != "no_zero_grad":  # else param.grad accumulates over steps, in its dtype (torch's)
                o.zero_grad()
        same(ref, ours, ropt, opt)
    ropt.close()
    return opt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("flow", ["plain", "clip", "last_micro_batch", "no_zero_grad"])
def test_master_bounded_is_the_master_scheme_bit_for_bit(flow, dtype):
    """One backward per step: the streamed update reading the fp16/bf16 gradient chunk by chunk gives the bits of
    the master scheme's fp32 sum of it (the user's clip_grad_norm_, last_micro_batch()'s updates from the hooks);
    the host keeps the fp32 master and moments (12 bytes per parameter) and the ring, nothing staged."""
    opt = run_master(flow, dtype)
    st, n = opt.stats(), 6
    numel = sum(p.numel() for p in mlp(dtype).parameters())
    assert st["streamed_params"] == n and st["spec_updates"] == 0
    assert st["eager_updates"] == (3 * n if flow == "last_micro_batch" else 0)
    assert st["host_state_bytes"] == 12 * numel + st["stream_ring_bytes"] == st["host_plan_needed"]
    opt.close()


@pytest.mark.parametrize("flow,dtype,kw", [
    ("plain", torch.bfloat16, dict(fused=True)), ("last_micro_batch", torch.float16, dict(amsgrad=True)),
    ("last_micro_batch", torch.bfloat16, dict(foreach=False, maximize=True)),
    ("scaler", torch.float16, dict(fused=True)), ("scaler", torch.bfloat16, dict(fused=True)),
    ("scaler_unscale", torch.bfloat16, {})], ids=["fused", "amsgrad", "single-maximize", "scaler-fused-fp16",
                                                 "scaler-fused-bf16", "scaler-unscale_-bf16"])
def test_master_bounded_recipes_and_grad_scaler(flow, dtype, kw):
    """Other recipes through the ring, and GradScaler where the scheme's sum is reproduced: fused (the kernel divides
    the fp32 gradient by the scale, as the scheme's) and scaler.unscale_(opt) before step (param.grad unscaled)."""
    run_master(flow, dtype, steps=4, **kw).close()


def test_master_bounded_checkpoints_move_both_ways():
    """state_dict() (master_param included) from the bounded optimizer into the unbounded one and back, and
    copy.deepcopy: training goes on with the master scheme's bits."""
    import copy

    ref, ours = mlp(torch.bfloat16), mlp(torch.bfloat16)
    ropt = OffloadAdamW(ref.parameters(), lr=1e-2, master_weights=True, threads=2)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, master_weights=True, threads=2, bounded_staging=True)
    for i, x in enumerate(data(5)):
        for m, o in ((ref, ropt), (ours, opt)):
            loss_fn(m, x).backward()
            o.step()
            o.zero_grad()
        if i == 1:
            sd = opt.state_dict()
            assert all("master_param" in e for e in sd["state"].values())
            ropt.load_state_dict(copy.deepcopy(sd))
        if i == 2:
            opt.load_state_dict(copy.deepcopy(ropt.state_dict()))
            twin = copy.deepcopy(opt)
            assert twin.stats()["streamed_params"] == 6
            twin.close()
        same(ref, ours, ropt, opt)
    ropt.close()
    opt.close()


def test_master_bounded_refusals_change_nothing():
    """What the streamed update cannot reproduce raises NotImplementedError naming it, the weights, param.grad and
    the state as they were: max_grad_norm (at construction), opt.clip_grad_norm(), a second backward before step()
    (at its hook, then at step()), GradScaler's unscaling inside step(); the loop goes on with the scheme's bits
    (not after GradScaler's: its found_inf and grad_scale stay on the optimizer when step() raises)."""
    ref, ours = mlp(torch.bfloat16), mlp(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="max_grad_norm= is not built"):
        OffloadAdamW(ours.parameters(), master_weights=True, bounded_staging=True, max_grad_norm=1.0)
    hyper = dict(lr=1e-2, weight_decay=0.1, master_weights=True, threads=2)
    ropt = OffloadAdamW(ref.parameters(), **hyper)
    opt = OffloadAdamW(ours.parameters(), **hyper, bounded_staging=True)
    xs = data(4)

    def step(x):
        for m, o in ((ref, ropt), (ours, opt)):
            loss_fn(m, x).backward()
            o.step()
            o.zero_grad()
        same(ref, ours, ropt, opt)

    step(xs[0])
    loss_fn(ours, xs[1]).backward()
    before = snapshot(ours, opt)
    with pytest.raises(NotImplementedError, match=r"clip_grad_norm\(\) \(parameter 0\) is not built"):
        opt.clip_grad_norm(0.05)
    unchanged(before, ours, opt)
    opt.zero_grad()
    step(xs[1])
    loss_fn(ours, xs[2]).backward()
    before = snapshot(ours, opt)
    with pytest.raises(NotImplementedError, match="a second backward before step"):
        loss_fn(ours, xs[3]).backward()  # refused at the hook of its first parameter's gradient
    unchanged(before, ours, opt, grads=False)  # torch summed that one gradient into param.grad before the hook
    before = snapshot(ours, opt)
    with pytest.raises(NotImplementedError, match="a second backward before step"):
        opt.step()
    unchanged(before, ours, opt)
    opt.zero_grad()
    step(xs[2])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(loss_fn(ours, xs[3])).backward()
    before = snapshot(ours, opt)
    with pytest.raises(NotImplementedError, match=r"GradScaler's step\(optimizer\) without scaler.unscale_"):
        scaler.step(opt)
    unchanged(before, ours, opt)  # param.grad still scaled: nothing unscaled it
    ropt.close()
    opt.close()


def test_master_bounded_second_backward_after_last_micro_batch():
    """A backward after a last_micro_batch() backward: the updates ran from the first one's hooks; the refusal says
    so (a checkpoint to reload), as bounded staging's refusals there."""
    ours = mlp(torch.bfloat16)
    opt = OffloadAdamW(ours.parameters(), master_weights=True, threads=2, bounded_staging=True)
    x = data(1)[0]
    with opt.last_micro_batch():
        loss_fn(ours, x).backward()
    with pytest.raises(NotImplementedError, match="reload a checkpoint"):
        loss_fn(ours, x).backward()
    opt.close()


def test_master_bounded_refused_where_the_scheme_has_no_sums(monkeypatch):
    """Several processes (DDP, FSDP2): the master path stages param.grad as they reduce it, not verified against the
    streamed update; refused at registration, before anything is allocated."""
    from trainstream.torch import _dist

    monkeypatch.setattr(_dist, "world", lambda: (0, 2))
    with pytest.raises(NotImplementedError, match="built for one process"):
        OffloadAdamW(mlp(torch.bfloat16).parameters(), master_weights=True, bounded_staging=True, threads=2)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cpu", "hybrid"])
@pytest.mark.parametrize("flow", ["plain", "clip", "last_micro_batch"])
def test_master_bounded_on_cuda(flow, mode):
    """The CUDA path against the master scheme on CUDA (its pinned staging and fp32 sums on the host): the pinned
    ring, the chunk copies on the side streams, the rounded weights uploaded from the gradient's place in the ring,
    hybrid's host share streamed beside its GPU share."""
    _cuda()
    opt = run_master(flow, torch.bfloat16, "cuda", steps=4, mode=mode,
                     **({"gpu_share": 0.5} if mode == "hybrid" else {}))
    st = opt.stats()
    assert st["pinned_state_bytes"] >= st["stream_ring_bytes"] > 0
    assert st["host_state_bytes"] == st["host_plan_needed"]
    opt.close()


@pytest.mark.gpu
def test_master_bounded_on_cuda_fp16_fused_grad_scaler_and_a_refusal():
    """fp16 with fused=True under GradScaler on CUDA (the kernel divides by the scale), then a second backward
    refused at its hook with the CUDA weights, gradients and state unchanged."""
    _cuda()
    opt = run_master("scaler", torch.float16, "cuda", steps=4, fused=True)
    opt.close()
    ours = mlp(torch.bfloat16, "cuda")
    opt = OffloadAdamW(ours.parameters(), master_weights=True, threads=2, bounded_staging=True)
    x = data(1, "cuda")[0]
    loss_fn(ours, x).backward()
    opt.step()
    loss_fn(ours, x).backward()
    before = snapshot(ours, opt)
    with pytest.raises(NotImplementedError, match="a second backward before step"):
        loss_fn(ours, x * 0.5).backward()
    with pytest.raises(NotImplementedError, match="a second backward before step"):
        opt.step()
    unchanged(before, ours, opt, grads=False)  # (torch summed one gradient into param.grad before its hook)
    opt.close()
