"""The loops users actually run, each bit for bit against the same loop with
torch.optim.AdamW, with no call a user would not make with it (no ``synchronize()``):
reads right after ``step()``, edits between steps, ``module.zero_grad()``, ``GradScaler``,
clipping, ``AveragedModel``, ``torch.compile``, torch.distributed.checkpoint,
transformers' Trainer and Lightning's. CPU here; the CUDA versions carry the ``gpu`` mark.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from trainstream.torch import OffloadAdamW  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)
# CUDA: every placement; mode "overlap" is cpu mode with overlap_forward (reads then need
# synchronize(): only the forward is checked there); "+res": the first layer's state
# resident in GPU memory (see mode_kw)
DEVICES_MODES = [pytest.param("cpu", "cpu", id="cpu")] + [
    pytest.param("cuda", m, id=f"cuda-{m}", marks=pytest.mark.gpu)
    for m in ("cpu", "gpu", "hybrid", "cpu+res", "gpu+res", "hybrid+res")]


def mode_kw(mode):
    """OffloadAdamW's arguments for a test mode: ``hybrid`` with half of the GPU share;
    ``+res`` with ``gpu_state_bytes=2304``: of mlp()'s fp32 state the first layer's (2048 +
    256 bytes), of its bf16 state the biases of the first two layers and the last weight
    (384 + 384 + 1536 bytes), the rest as the mode says (hybrid: host and zero-copy)."""
    base, _, res = mode.partition("+")
    return dict(mode=base, **(dict(gpu_share=0.5) if base == "hybrid" else {}),
                **(dict(gpu_state_bytes=2304) if res else {}))


def mlp(seed=0, dtype=torch.float32, device="cpu", width=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 4)).to(device=device, dtype=dtype)


def pair(device="cpu", mode="cpu", dtype=torch.float32, lr=1e-2, **kw):
    """Two equal models: one with torch.optim.AdamW, one with OffloadAdamW."""
    ref, ours = mlp(dtype=dtype, device=device), mlp(dtype=dtype, device=device)
    return (ref, torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1),
            ours, OffloadAdamW(ours.parameters(), lr=lr, weight_decay=0.1, threads=2, **mode_kw(mode),
                               **({"master_weights": True} if dtype != torch.float32 else {}), **kw))


def data(n, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g).to(device) for _ in range(n)]


def loss_fn(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{n} differs"


# -- reads right after step() ------------------------------------------------------------------


@pytest.mark.parametrize("device,mode", DEVICES_MODES)
def test_every_read_right_after_step_sees_the_new_weights(device, mode):
    """state_dict, torch.save, deepcopy, p.norm(), a functional call, AveragedModel: each read
    right after step() sees torch.optim.AdamW's new weights (4 of 4 stale before)."""
    ref, ropt, ours, opt = pair(device, mode)
    avg_ref, avg_ours = (torch.optim.swa_utils.AveragedModel(m) for m in (ref, ours))
    for x in data(4, device):
        for m, o in ((ref, ropt), (ours, opt)):
            o.zero_grad()
            loss_fn(m, x).backward()
            o.step()
        for (k, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
            assert torch.equal(a, b), k
        buf = io.BytesIO()
        torch.save(ours.state_dict(), buf)
        buf.seek(0)
        for a, b in zip(ref.state_dict().values(), torch.load(buf).values()):
            assert torch.equal(a, b)
        same(ref, copy.deepcopy(ours))
        assert [p.norm() for p in ref.parameters()] == [p.norm() for p in ours.parameters()]
        w_ref, w_ours = ref[0].weight, ours[0].weight
        assert torch.equal(torch.nn.functional.linear(x, w_ref), torch.nn.functional.linear(x, w_ours))
        avg_ref.update_parameters(ref)
        avg_ours.update_parameters(ours)
        same(avg_ref, avg_ours)
    opt.close()


# -- the optimizer honors the parameters as they are -------------------------------------------


@pytest.mark.parametrize("eager", [False, True], ids=["", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("device,mode", DEVICES_MODES)
def test_weights_changed_between_steps_are_what_it_updates(device, mode, dtype, eager):
    """An in-place edit, model.load_state_dict and a re-initialised layer between steps
    (the optimizer's state untouched): updated from the new weights, as torch would. bf16:
    against AdamW on an fp32 master that takes the same edits."""
    ref, _, ours, opt = pair(device, mode, dtype=dtype)
    master = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ropt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    other = mlp(seed=5, dtype=dtype, device=device)
    edits = {
        1: lambda m: m[0].weight.mul_(0.5),
        2: lambda m: m.load_state_dict(other.state_dict()),
        3: lambda m: nn.init.zeros_(m[2].bias),
    }
    for i, x in enumerate(data(5, device)):
        if i in edits:
            with torch.no_grad():
                for m in (ref, ours):
                    edits[i](m)
                for p, q in zip(master, ref.parameters()):
                    if not torch.equal(p.to(dtype), q):  # the edited elements
                        p.copy_(torch.where(p.to(dtype) == q, p, q.float()))
        loss = loss_fn(ref, x)
        loss.backward()
        for p, q in zip(master, ref.parameters()):
            p.grad = q.grad.float()
            q.grad = None
        ropt.step()
        with torch.no_grad():
            for p, q in zip(master, ref.parameters()):
                q.copy_(p)
        opt.zero_grad()
        if eager:
            with opt.last_micro_batch():
                loss_fn(ours, x).backward()
        else:
            loss_fn(ours, x).backward()
        opt.step()
        same(ref, ours)
    opt.close()


def test_replaced_storage_is_followed_and_a_dtype_change_refused_clearly():
    ref, ropt, ours, opt = pair()
    for i, x in enumerate(data(4)):
        if i == 2:
            for m in (ref, ours):
                m[2].weight.data = m[2].weight.data.clone().mul_(2)  # p.data = ...
        for m, o in ((ref, ropt), (ours, opt)):
            o.zero_grad()
            loss_fn(m, x).backward()
            o.step()
    same(ref, ours)
    ours.double()
    with pytest.raises(RuntimeError, match=r"dtype torch.float32 -> torch.float64 \(float64 is not supported"):
        loss_fn(ours, data(1)[0].double()).backward()
    opt.close()
    # one optimizer's failure stays its own: other models train and run on
    m2 = mlp(3)
    o2 = OffloadAdamW(m2.parameters(), lr=1e-2)
    loss_fn(m2, data(1)[0]).backward()
    o2.step()
    o2.close()


def test_a_failed_optimizer_leaves_unrelated_modules_alone():
    """A worker failure is raised by its own optimizer's next call; no other module's
    forward (no hook of it anywhere else, also with overlap_forward)."""
    from trainstream import _host_kernels as K

    model = mlp()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, threads=2, overlap_forward=model, speculate=False)
    real, K.adamw_chunk = K.adamw_chunk, None  # every update raises (at step(): not speculative)
    try:
        loss_fn(model, data(1)[0]).backward()
        opt.step()
        with pytest.raises(Exception, match="TrainStream optimizer worker failed"):
            opt.synchronize()
    finally:
        K.adamw_chunk = real
    unrelated = mlp(4)
    unrelated(data(1)[0]).sum().backward()
    opt.close()


# -- gradients as users handle them ------------------------------------------------------------


@pytest.mark.parametrize("device,mode", DEVICES_MODES)
def test_module_zero_grad_dcgan_pattern(device, mode):
    """Two models, two optimizers; the discriminator also receives gradients from the
    generator's loss, which netD.zero_grad() (module.zero_grad) discards."""
    gen_r, disc_r = mlp(seed=2, device=device), mlp(seed=1, device=device)
    gen_o, disc_o = mlp(seed=2, device=device), mlp(seed=1, device=device)
    opts_r = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (gen_r, disc_r)]
    opts_o = [OffloadAdamW(m.parameters(), lr=1e-2, threads=2, **mode_kw(mode)) for m in (gen_o, disc_o)]
    for x in data(4, device):
        for gen, disc, (og, od) in ((gen_r, disc_r, opts_r), (gen_o, disc_o, opts_o)):
            disc.zero_grad()
            fake = torch.tanh(gen(x)[:, :4].repeat(1, 2))
            (disc(x).square().mean() + disc(fake.detach()).mean()).backward()
            od.step()
            gen.zero_grad()
            (-disc(fake).mean()).backward()  # also gives disc gradients: dropped next time
            og.step()
        same(gen_r, gen_o)
        same(disc_r, disc_o)
    for o in opts_o:
        o.close()


@pytest.mark.parametrize("how", ["method", "max_grad_norm", "clip_grad_norm_", "micro2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("device,mode", DEVICES_MODES)
def test_clipping_like_clip_grad_norm(device, mode, dtype, how):
    """opt.clip_grad_norm / max_grad_norm (no second copy of the gradients) and the user's
    own clip_grad_norm_ (copied again at step()): the bits of clip_grad_norm_ + AdamW;
    bf16 (master_weights=True) against AdamW on an fp32 master whose gradients are the fp32 sums of the
    micro-batches', clipped there (the user's clip_grad_norm_ of param.grad: the clipped bf16 gradients). On CUDA
    the fp32 sums are those of host slots, in host memory (torch's CPU norm); GPU and resident slots keep
    param.grad in bf16 (docs/torch.md, master_weights); the reference follows both."""
    ref, _, ours, _ = pair(device, mode, dtype=dtype)
    master = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ropt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, threads=2, master_weights=dtype != torch.float32,
                       max_grad_norm=0.05 if how == "max_grad_norm" else None, **mode_kw(mode))
    micro = 2 if how == "micro2" else 1
    sums = [opt._slots.of(p).sums for p in ours.parameters()]  # which slots sum in fp32 on the host
    for x in data(4, device):
        acc16 = [None] * len(master)
        for k, part in enumerate(x.chunk(micro)):
            loss_fn(ref, part).backward()
            loss_fn(ours, part).backward()
            for i, (p, q) in enumerate(zip(master, ref.parameters())):  # fp32 sums of the micro-batches' gradients
                p.grad = q.grad.float() if k == 0 else p.grad + q.grad.float()
                acc16[i] = q.grad if k == 0 else acc16[i] + q.grad  # and autograd's, in param.grad's dtype
                if micro > 1:
                    q.grad = None
        if how == "clip_grad_norm_":  # one micro-batch: clipped in param.grad's dtype, then copied
            n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            for p, q in zip(master, ref.parameters()):
                p.grad = q.grad.float()
        elif device == "cuda" and dtype != torch.float32:
            # the fp32 sums of host slots are in host memory (torch's CPU norm of them); a GPU or resident slot keeps
            # param.grad as autograd sums it, in its dtype (as under DDP/FSDP2): the norm over both, as ours takes it
            n_ref = torch.nn.utils.get_total_norm([p.grad.cpu() if s else g for p, g, s in zip(master, acc16, sums)])
            coef = torch.clamp(0.05 / (n_ref + 1e-6), max=1.0)
            for p, g, s in zip(master, acc16, sums):
                p.grad = p.grad * coef.to(device) if s else (g * coef.to(device)).float()
        else:
            n_ref = torch.nn.utils.clip_grad_norm_(master, 0.05)
        if how in ("method", "micro2"):
            n = opt.clip_grad_norm(0.05)
        elif how == "clip_grad_norm_":
            n = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)
        opt.step()
        if how == "max_grad_norm":
            n = opt.last_grad_norm()
        assert float(n) == float(n_ref) and float(n_ref) > 0.05  # clipping active
        for q in ref.parameters():
            q.grad = None
        ropt.step()
        with torch.no_grad():
            for p, q in zip(master, ref.parameters()):
                q.copy_(p)
        opt.zero_grad()
        same(ref, ours)
    opt.close()


def test_clip_grad_norm_in_the_models_order_and_after_an_eager_backward():
    """Weight-decay groups list the parameters in another order than the model: torch's
    norm sums per-tensor norms in the order given, so ``parameters=model.parameters()``
    gives clip_grad_norm_(model.parameters())'s bits. After a last_micro_batch() backward
    the gradients are there (issue 42): torch's norm and bits."""
    ref, ours = mlp(), mlp()

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.ndim > 1]},
                {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0}]

    ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
    opt = OffloadAdamW(groups(ours), lr=1e-2, threads=2)
    for x in data(3):
        for m in (ref, ours):
            loss_fn(m, x).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert float(opt.clip_grad_norm(0.05, parameters=ours.parameters())) == float(want)
        ropt.step()
        opt.step()
        ropt.zero_grad()
        opt.zero_grad()
        same(ref, ours)
    x = data(1)[0]
    loss_fn(ref, x).backward()
    with opt.last_micro_batch():
        loss_fn(ours, x).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert float(opt.clip_grad_norm(0.05, parameters=ours.parameters())) == float(want)
    ropt.step()
    opt.step()
    same(ref, ours)
    opt.close()


@pytest.mark.parametrize("flow", ["plain", "unscale_clip", "max_grad_norm", "inf"])
@pytest.mark.parametrize("device,mode", DEVICES_MODES)
def test_grad_scaler(device, mode, flow):
    """GradScaler: scale, step (the optimizer unscales, as torch's fused ones do), update;
    unscale_ then clip_grad_norm_; a step skipped for an inf gradient."""
    ref, ropt, ours, _ = pair(device, mode)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, threads=2,
                       max_grad_norm=0.05 if flow == "max_grad_norm" else None, **mode_kw(mode))
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=2) for _ in range(2)]
    for i, x in enumerate(data(5, device)):
        for m, o, sc in ((ref, ropt, scalers[0]), (ours, opt, scalers[1])):
            o.zero_grad()
            loss = loss_fn(m, x)
            if flow == "inf" and i == 2:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            if flow in ("unscale_clip", "max_grad_norm"):
                if o is ropt or flow == "unscale_clip":
                    sc.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            sc.step(o)
            sc.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        same(ref, ours)
    assert len(opt.state) == len(list(ours.parameters()))
    assert int(opt.state[ours[0].weight]["step"]) == (4 if flow == "inf" else 5)
    opt.close()


def test_grad_scaler_with_last_micro_batch():
    """GradScaler after a last_micro_batch() backward (issue 42): torch's bits (the speculative
    update, from the scaled gradients, is redone)."""
    ref, ropt, ours, opt = pair()
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    x = data(1)[0]
    scalers[0].scale(loss_fn(ref, x)).backward()
    with opt.last_micro_batch():
        scalers[1].scale(loss_fn(ours, x)).backward()
    for o, sc in ((ropt, scalers[0]), (opt, scalers[1])):
        sc.step(o)
        sc.update()
    same(ref, ours)
    opt.close()


# -- compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_compiled_model_trains_and_reads_bit_identically(device, how):
    """No hook of the optimizer on the model (default): Dynamo traces the model alone."""
    def compiled(seed):
        m = mlp(seed, device=device, width=64)
        if how == "torch.compile":
            return m, torch.compile(m)
        m.compile()
        return m, m

    (ref, cref), (ours, cours) = compiled(3), compiled(3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, threads=2)
    for i, x in enumerate(data(4, device)):
        for m, o in ((cref, ropt), (cours, opt)):
            o.zero_grad()
            loss = loss_fn(m, x)
            if o is opt and i % 2:
                with opt.last_micro_batch():
                    loss.backward()
            else:
                loss.backward()
            o.step()
        same(ref, ours)
        assert torch.equal(cref(x), cours(x))
    opt.close()


# -- torch.distributed.checkpoint ---------------------------------------------------------------


@pytest.mark.parametrize("direction", ["ours->adamw", "adamw->ours"])
def test_distributed_checkpoint_round_trip(tmp_path, direction):
    """get/set_optimizer_state_dict and dcp.save/load both ways with torch.optim.AdamW; no
    hidden zero-gradient step on a trained optimizer (the state is real)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

    def make(kind, seed=0):
        m = mlp(seed)
        groups = [{"params": [p for p in m.parameters() if p.ndim > 1], "weight_decay": 0.1},
                  {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0}]
        cls = OffloadAdamW if kind == "ours" else torch.optim.AdamW
        return m, cls(groups, lr=1e-2, **(dict(threads=2) if kind == "ours" else {}))

    first, second = direction.split("->")
    xs = data(6)
    m1, o1 = make(first)
    m_ref, o_ref = make("adamw")  # the uninterrupted run
    for x in xs[:3]:
        for m, o in ((m1, o1), (m_ref, o_ref)):
            o.zero_grad()
            loss_fn(m, x).backward()
            o.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process DCP warns about no process group
        osd = get_optimizer_state_dict(m1, o1)
        assert all(int(s["step"]) == 3 for s in osd["state"].values())  # no hidden step
        dcp.save({"model": get_model_state_dict(m1), "optim": osd}, checkpoint_id=str(tmp_path))
        m2, o2 = make(second, seed=9)
        sd = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, o2)}
        dcp.load(sd, checkpoint_id=str(tmp_path))
        set_model_state_dict(m2, sd["model"])
        set_optimizer_state_dict(m2, o2, sd["optim"])
    for x in xs[3:]:
        for m, o in ((m2, o2), (m_ref, o_ref)):
            o.zero_grad()
            loss_fn(m, x).backward()
            o.step()
    same(m_ref, m2)
    for o in (o1, o2):
        if isinstance(o, OffloadAdamW):
            o.close()


def test_optimizer_state_is_the_real_state():
    ref, ropt, ours, opt = pair()
    assert not opt.state and len(opt.state) == 0
    for x in data(2):
        for m, o in ((ref, ropt), (ours, opt)):
            loss_fn(m, x).backward()
            o.step()
    assert len(opt.state) == len(ropt.state)
    for p, q in zip(ref.parameters(), ours.parameters()):
        a, b = ropt.state[p], opt.state[q]
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    # the engine's own writes leave param._version alone (no needless re-read of the weights)
    assert [p._version for p in ours.parameters()] == [rec.version for rec in opt._slots]
    # Lightning moves optimizer state to the model's device at fit/resume: passing copies,
    # the state stays in host memory
    try:
        from lightning.fabric.utilities.optimizer import _optimizer_to_device
    except ImportError:
        pass
    else:
        _optimizer_to_device(opt, torch.device("meta"))
        assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values())
    # views: a change in place is the optimizer's state; a state_dict round trip too
    opt.state[ours[0].weight]["exp_avg"].mul_(0)
    ropt.state[ref[0].weight]["exp_avg"].mul_(0)
    opt.load_state_dict(opt.state_dict())
    for m, o in ((ref, ropt), (ours, opt)):
        loss_fn(m, data(1, seed=7)[0]).backward()
        o.step()
    same(ref, ours)
    opt.close()


# -- trainers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_transformers_trainer_accumulation_clipping_checkpoint_resume(tmp_path, device):
    """transformers' Trainer (gradient accumulation, its default clipping, a checkpoint at
    step 2 and a resume from it): every model.safetensors is torch.optim.AdamW's."""
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (16, 16), generator=g)
    dataset = [{"input_ids": r, "labels": r} for r in ids]

    def run(out, opt_kind, resume=None, max_steps=4):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=max_steps, save_steps=2, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5,
            lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, report_to=[], use_cpu=device == "cpu",
            seed=0, data_seed=0, optim="adamw_torch", disable_tqdm=True)
        kw = {}
        if opt_kind == "ours":
            kw["optimizer_cls_and_kwargs"] = (OffloadAdamW, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                                                  threads=2))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, **kw)
        trainer.train(resume_from_checkpoint=resume)
        if opt_kind == "ours":
            trainer.ts_stats = trainer.optimizer.optimizer.stats()
            trainer.optimizer.optimizer.close()  # (accelerate wraps it)
        return trainer

    runs = {kind: run(tmp_path / kind, kind) for kind in ("adamw", "ours")}
    resumed = run(tmp_path / "ours", "ours", resume=str(tmp_path / "ours" / "checkpoint-2"))
    load = safetensors.load_file
    for ck in ("checkpoint-2", "checkpoint-4"):
        want = load(tmp_path / "adamw" / ck / "model.safetensors")
        got = load(tmp_path / "ours" / ck / "model.safetensors")  # checkpoint-4: the resumed run's
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), f"{ck}: {k}"
    logged = [[h.get("grad_norm") for h in r.state.log_history if "grad_norm" in h] for r in runs.values()]
    assert logged[0] == logged[1] and all(n > 0 for n in logged[0])  # clipping saw the gradients
    for a, b in zip(runs["adamw"].model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    st = runs["ours"].ts_stats  # speculated from the second step, its copies taken ahead (the checkpoint's views gone)
    assert st["spec_updates"] > 0 and st["precopy_ms_total"] > 0, st


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_lightning_trainer_clipping_and_accumulation(device):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self, kind):
            super().__init__()
            self.kind, self.net = kind, mlp(0)

        def training_step(self, batch, _):
            return loss_fn(self.net, batch)

        def configure_optimizers(self):
            cls = OffloadAdamW if self.kind == "ours" else torch.optim.AdamW
            return cls(self.net.parameters(), lr=1e-2, weight_decay=0.1,
                       **(dict(threads=2) if self.kind == "ours" else {}))

    nets = []
    for kind in ("adamw", "ours"):
        module = Module(kind)
        trainer = pl.Trainer(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05,
                             accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False,
                             enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no worker processes for the loader, etc.
            trainer.fit(module, torch.utils.data.DataLoader(data(6), batch_size=None))
        nets.append(module.net)
        if kind == "ours":
            st = trainer.optimizers[0].stats()
            trainer.optimizers[0].close()
    same(*nets)
    assert st["spec_updates"] > 0 and st["precopy_ms_total"] > 0, st  # Lightning's loop speculates, copies ahead
