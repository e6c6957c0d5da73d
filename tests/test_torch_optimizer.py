"""OffloadAdamW against torch.optim.AdamW (CPU parameters; the CUDA twin is test_torch_gpu)."""

from __future__ import annotations

import copy
import gc
import threading
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from trainstream import _host_kernels as K  # noqa: E402
from trainstream.core._engine import WorkerError  # noqa: E402
from trainstream.torch import OffloadAdamW  # noqa: E402

from _torch_helpers import (  # noqa: E402
    assert_same,
    backward,
    batches,
    chunked,
    loss_of,
    make_model,
    train_pair,
    two_groups,
)


@pytest.mark.isa
def test_two_groups_bit_identical():
    ref_model, ts_model, _, ts, _ = train_pair()
    assert_same(ref_model, ts_model)
    st = ts.stats()
    assert st["steps"] == 50 and st["params"] == len(list(ts_model.parameters()))
    ts.close()


def test_scheduler_bit_identical():
    ref_model, ts_model, ref, ts, _ = train_pair(steps=30, sched=True)
    assert_same(ref_model, ts_model)
    assert [g["lr"] for g in ref.param_groups] == [g["lr"] for g in ts.param_groups]
    ts.close()


@pytest.mark.isa
def test_accumulation_four_micro_batches():
    """Micro-batches are summed in param.grad, as torch sums them; the first step's hooks copy
    each running sum to the host (not knowing which is the last), later steps' only the fourth."""
    ref_model, ts_model, _, ts, _ = train_pair(steps=20, micro=4)
    assert_same(ref_model, ts_model)
    nbytes = sum(p.numel() * p.element_size() for p in ts_model.parameters())
    assert ts.stats()["grad_bytes_offloaded"] == (4 + 19) * nbytes
    ts.close()


@pytest.mark.isa
def test_eager_last_micro_batch():
    ref_model, ts_model, _, ts, _ = train_pair(steps=20, micro=2, eager=True)
    assert_same(ref_model, ts_model)
    assert ts.stats()["eager_updates"] > 0
    ts.close()


@pytest.mark.isa
def test_clipping_matches_clip_grad_norm():
    ref_model, ts_model, _, ts, norms = train_pair(steps=25, max_norm=0.5)
    assert_same(ref_model, ts_model)
    assert min(norms) > 0.5  # the clip was active
    ts.close()


@pytest.mark.parametrize("threads,chunk", [(1, 4096), (2, 8192), (5, 4096), (5, 1 << 20)])
def test_threads_and_chunks_identical(threads, chunk):
    _, base, _, ts0, n0 = train_pair(steps=8, max_norm=0.5, threads=1, chunk=1 << 20)
    _, other, _, ts1, n1 = train_pair(steps=8, max_norm=0.5, threads=threads, chunk=chunk)
    assert n0 == n1
    assert_same(base, other)
    ts0.close()
    ts1.close()


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_params_against_fp32_master(dtype, micro):
    """master_weights=True: fp16/bf16 weights against torch.optim.AdamW on an fp32 master whose gradient is the
    fp32 sum of the micro-batches' gradients (param.grad holds the last micro-batch's); the rounded weights staged
    in the gradient's buffer."""
    model = make_model(dtype=dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    with chunked(4096):
        ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=2, master_weights=True)
    slot = ts._engine.host._slot(0)
    assert slot.param_stage is slot.grad_stage
    for x in batches(20):
        for k, part in enumerate(x.chunk(micro)):
            loss_of(model, part).backward()
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float() if k == 0 else m.grad + p.grad.float()
        ts.step()
        ts.zero_grad()
        ref.step()
        for sid, (p, m) in enumerate(zip(model.parameters(), master)):
            ours = ts.state_dict()["state"][sid]["master_param"] if sid == 0 else None
            if ours is not None:
                assert torch.equal(ours, m.detach())
            assert torch.equal(p.detach(), m.detach().to(dtype))
    sd = ts.state_dict()
    for sid, m in enumerate(master):
        assert torch.equal(sd["state"][sid]["master_param"], m.detach())
        assert torch.equal(sd["state"][sid]["exp_avg"], ref.state[m]["exp_avg"])
    ts.close()


def test_checkpoint_resume_and_interop(tmp_path):
    data = batches(40)
    model = make_model()
    with chunked(4096):
        ts = OffloadAdamW(two_groups(model), threads=2)

    def run(m, opt, xs):
        for x in xs:
            opt.zero_grad()
            loss_of(m, x).backward()
            opt.step()

    run(model, ts, data[:20])
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": ts.state_dict()}, path)
    run(model, ts, data[20:])  # the uninterrupted run

    ck = torch.load(path)
    m2 = make_model()
    m2.load_state_dict(ck["model"])
    with chunked(8192):
        ts2 = OffloadAdamW(two_groups(m2), threads=3)
    ts2.load_state_dict(ck["opt"])
    run(m2, ts2, data[20:])
    assert_same(model, m2)

    m3 = make_model()
    m3.load_state_dict(ck["model"])
    ref = torch.optim.AdamW(two_groups(m3))
    ref.load_state_dict(ck["opt"])
    run(m3, ref, data[20:])
    assert_same(model, m3)

    # ... and a torch.optim.AdamW checkpoint loads into OffloadAdamW.
    m4 = make_model()
    m4.load_state_dict(m3.state_dict())
    ts4 = OffloadAdamW(two_groups(m4))
    ts4.load_state_dict(ref.state_dict())
    run(m3, ref, data[:5])
    run(m4, ts4, data[:5])
    assert_same(m3, m4)
    for o in (ts, ts2, ts4):
        o.close()


def test_frozen_and_unused_parameters_left_alone():
    model = make_model()
    model.emb.weight.requires_grad_(False)
    extra = nn.Parameter(torch.randn(5))  # never receives a gradient
    before = (model.emb.weight.clone(), extra.detach().clone())
    ts = OffloadAdamW([*model.parameters(), extra], threads=1)
    for x in batches(3):
        ts.zero_grad()
        loss_of(model, x).backward()
        ts.step()
    assert torch.equal(model.emb.weight, before[0])
    assert torch.equal(extra.detach(), before[1])
    assert 0 not in ts.state_dict()["state"]
    ts.close()


def test_gradients_kept_also_by_last_micro_batch():
    """param.grad is autograd's, as with torch.optim.AdamW (also after step()), a
    last_micro_batch() backward's too (issue 42: clipping and GradScaler need it)."""
    model, ref = make_model(), make_model()
    ts = OffloadAdamW(model.parameters(), threads=1)
    x = batches(1)[0]
    loss_of(model, x).backward()
    loss_of(ref, x).backward()
    ts.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    ts.zero_grad()
    ref = copy.deepcopy(model)  # the weights as they are now, no gradients
    with ts.last_micro_batch():
        loss_of(model, x).backward()
    loss_of(ref, x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    ts.step()
    ts.close()


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_rejects_unsupported_dtypes(dtype):
    p = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        OffloadAdamW([p])


def test_rejects_bad_hyperparameters():
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        OffloadAdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        OffloadAdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="Invalid epsilon"):
        OffloadAdamW([p], eps=-1e-8)
    with pytest.raises(ValueError, match="Invalid weight_decay"):
        OffloadAdamW([p], weight_decay=-0.1)
    with pytest.raises(ValueError, match="mode"):
        OffloadAdamW([p], mode="tpu")
    with pytest.raises(NotImplementedError, match="differentiable"):
        OffloadAdamW([p], differentiable=True)


def test_rejects_non_contiguous_and_other_devices():
    base = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="not contiguous"):
        OffloadAdamW([nn.Parameter(base.t())])
    with pytest.raises(ValueError, match="unsupported device"):
        OffloadAdamW([nn.Parameter(torch.zeros(3, device="meta"))])


def test_sparse_gradient_is_refused():
    emb = nn.Embedding(10, 4, sparse=True)
    ts = OffloadAdamW(emb.parameters(), threads=1)
    with pytest.raises(RuntimeError, match="sparse gradients"):
        emb(torch.tensor([1, 2])).sum().backward()
    ts.close()


def test_mismatched_state_dict():
    model = make_model()
    ts = OffloadAdamW(two_groups(model), threads=1)
    for x in batches(2):
        loss_of(model, x).backward()
        ts.step()
    sd = ts.state_dict()
    other = OffloadAdamW(make_model().parameters(), threads=1)
    with pytest.raises(ValueError, match="parameter groups"):
        other.load_state_dict(sd)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    ts2 = OffloadAdamW(two_groups(make_model()), threads=1)
    before = ts2.state_dict()
    with pytest.raises(ValueError, match="shape"):
        ts2.load_state_dict(bad)
    assert ts2.state_dict()["state"] == before["state"]  # nothing half-loaded
    for step in (-1.0, 1.5, float("inf"), float("nan")):
        bad = copy.deepcopy(sd)
        bad["state"][0]["step"] = torch.tensor(step)
        with pytest.raises(ValueError, match="invalid step"):
            ts2.load_state_dict(bad)
    for o in (ts, other, ts2):
        o.close()


def test_closed_optimizer_refuses_work():
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=2)
    ts.close()
    with pytest.raises(RuntimeError, match="closed"):
        ts.step()
    with pytest.raises(RuntimeError, match="closed"):
        ts.state_dict()
    ts.close()  # idempotent


def _step_with_failing_kernel(ts, model, monkeypatch):
    """One backward and step() whose every host AdamW kernel raises; the WorkerError
    reaches synchronize()."""

    def boom(*args, **kwargs):
        raise FloatingPointError("injected kernel failure")

    monkeypatch.setattr(K, "adamw_chunk", boom)
    loss_of(model, batches(1)[0]).backward()
    ts.step()
    with pytest.raises(WorkerError, match="injected kernel failure"):
        ts.synchronize()


def test_worker_failure_reaches_caller(monkeypatch):
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=2, speculate=False)  # at step() (speculative: test_torch_speculate.py)
    _step_with_failing_kernel(ts, model, monkeypatch)
    monkeypatch.undo()
    ts.close()
    # the process is healthy: a new optimizer trains normally
    ref_model, ts_model, _, ts2, _ = train_pair(steps=3)
    assert_same(ref_model, ts_model)
    ts2.close()


def test_failed_update_uploads_nothing(monkeypatch):
    """A chunk that raised leaves its range of the staging buffer unwritten (with
    weights staged in the gradient buffer it holds gradient bits): the batch uploads
    nothing and the parameter keeps its weights until the error is dealt with."""
    model = make_model(dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    with chunked(4096):
        ts = OffloadAdamW(model.parameters(), threads=2, master_weights=True)
    _step_with_failing_kernel(ts, model, monkeypatch)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    monkeypatch.undo()
    ts.close()


def test_close_joins_workers_and_gc_closes():
    before = {t.name for t in threading.enumerate()}
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=3)
    assert sum(t.name.startswith("trainstream-worker") for t in threading.enumerate()) >= 3
    del ts
    gc.collect()
    after = {t.name for t in threading.enumerate() if t.name.startswith("trainstream-worker")}
    assert after <= {n for n in before if n.startswith("trainstream-worker")}


# -- torch.optim semantics kept (from review) ------------------------------------------------


def _ref_and_ts(**kw):
    m1, m2 = make_model(), make_model()
    return m1, m2, torch.optim.AdamW(m1.parameters(), **kw), OffloadAdamW(m2.parameters(), threads=2, **kw)


def test_unfrozen_and_hand_set_gradients_are_applied():
    m1, m2, ref, ts = _ref_and_ts(lr=1e-2)
    for m in (m1, m2):
        m.emb.weight.requires_grad_(False)
    x = batches(1)[0]
    for m, o in ((m1, ref), (m2, ts)):
        loss_of(m, x).backward()
        o.step()
        o.zero_grad()
        m.emb.weight.requires_grad_(True)  # unfrozen after the optimizer was built
        loss_of(m, x).backward()
        o.step()
        o.zero_grad()
        m.head.bias.grad = torch.full_like(m.head.bias, 0.5)  # set by hand
        o.step()
    assert_same(m1, m2)
    ts.close()


def test_load_state_dict_between_backward_and_step_keeps_the_gradients():
    """backward, load_state_dict, step: torch updates from the loaded state with param.grad;
    so does OffloadAdamW with the gradients its hooks copied (loading the state leaves the
    staged copies alone: whether one is current is the adapter's record's to say)."""
    m1, m2, ref, ts = _ref_and_ts(lr=1e-2)
    data = batches(3)
    for m, o in ((m1, ref), (m2, ts)):
        loss_of(m, data[0]).backward()
        o.step()
        o.zero_grad()
    saved = [copy.deepcopy(o.state_dict()) for o in (ref, ts)]
    for (m, o), sd in zip(((m1, ref), (m2, ts)), saved):
        loss_of(m, data[1]).backward()
        o.load_state_dict(sd)
        o.step()
    assert_same(m1, m2)
    assert ts.state_dict()["state"][0]["step"].item() == 2.0
    ts.close()


def test_stale_master_from_a_torch_round_trip_is_not_restored():
    model = make_model(dtype=torch.bfloat16)
    ts = OffloadAdamW(model.parameters(), lr=1e-2, threads=1, master_weights=True)
    data = batches(8)
    for x in data[:3]:
        loss_of(model, x).backward()
        ts.step()
    sd = ts.state_dict()
    ts.close()  # its hooks would take the reference's gradients
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref.load_state_dict(sd)  # torch keeps 'master_param' but never updates it
    for x in data[3:8]:
        ref.zero_grad()
        loss_of(model, x).backward()
        ref.step()
    ts2 = OffloadAdamW(model.parameters(), lr=1e-2, threads=1, master_weights=True)
    with pytest.warns(RuntimeWarning, match="does not round to the current weights"):
        ts2.load_state_dict(ref.state_dict())
    for sid, p in enumerate(model.parameters()):
        master = ts2.state_dict()["state"][sid]["master_param"]
        assert torch.equal(master.to(p.dtype), p.detach())
    ts2.close()


def test_load_state_dict_resets_parameters_without_saved_state_and_checks_flags():
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=1)
    fresh = ts.state_dict()
    for x in batches(2):
        loss_of(model, x).backward()
        ts.step()
    ts.load_state_dict(fresh)
    assert ts.state_dict()["state"] == {}
    bad = copy.deepcopy(fresh)
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(NotImplementedError, match="amsgrad"):
        ts.load_state_dict(bad)
    ts.close()


@pytest.mark.parametrize("eager", [False, True])
def test_replaced_parameter_storage_is_followed_or_refused(eager):
    """p.data = a new tensor of the same shape, dtype and device: updated there, from its
    values, as torch.optim.AdamW would; model.double() after building: a clear error."""
    m1, m2, ref, ts = _ref_and_ts(lr=1e-2)
    data = batches(4)
    for i, x in enumerate(data):
        for m, o in ((m1, ref), (m2, ts)):
            if i == 2:
                with torch.no_grad():
                    m.head.weight.data = m.head.weight.data * 0.5
            o.zero_grad()
            backward(o, loss_of(m, x), last=eager and o is ts)
            o.step()
    assert_same(m1, m2)
    m2.double()
    with pytest.raises(RuntimeError, match=r"parameter \d+ \(group 0\) was replaced after the optimizer was "
                                           r"built: dtype torch.float32 -> torch.float64 \(float64 is not"):
        backward(ts, m2(data[0]).sum(), last=eager)  # the gradient hook raises
    with pytest.raises(RuntimeError, match="float64 is not supported"):
        ts.step()
    ts.close()


def test_failed_add_param_group_leaves_optimizer_usable():
    m1, m2, ref, ts = _ref_and_ts(lr=1e-2)
    with pytest.raises(NotImplementedError, match="capturable"):
        ts.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "capturable": True})
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        ts.add_param_group({"params": [nn.Parameter(torch.zeros(3)), torch.zeros(2, dtype=torch.float64)]})
    assert len(ts.param_groups) == 1
    for x in batches(3):
        for m, o in ((m1, ref), (m2, ts)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
    assert_same(m1, m2)
    ts.close()


def test_add_param_group_after_construction():
    m1, m2 = make_model(), make_model()
    ref = torch.optim.AdamW(m1.head.parameters(), lr=1e-2)
    ts = OffloadAdamW(m2.head.parameters(), lr=1e-2, threads=2)
    data = batches(6)
    for i, x in enumerate(data):
        if i == 2:
            ref.add_param_group({"params": list(m1.layer.parameters()), "lr": 3e-3})
            ts.add_param_group({"params": list(m2.layer.parameters()), "lr": 3e-3})
        for m, o in ((m1, ref), (m2, ts)):
            o.zero_grad()
            loss_of(m, x).backward()
            o.step()
    assert_same(m1, m2)
    ts.close()


def test_worker_failure_is_sticky_until_reload(monkeypatch):
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=2, speculate=False)
    good = ts.state_dict()

    def boom(*args, **kwargs):
        raise FloatingPointError("injected")

    monkeypatch.setattr(K, "adamw_chunk", boom)
    loss_of(model, batches(1)[0]).backward()
    ts.step()
    with pytest.raises(WorkerError):
        ts.synchronize()
    monkeypatch.undo()
    with pytest.raises(WorkerError):
        ts.step()
    ts.load_state_dict(good)
    ts.zero_grad()
    loss_of(model, batches(1)[0]).backward()
    ts.step()
    ts.close()


def test_two_backwards_in_last_micro_batch_are_refused():
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=1)
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="second backward"):
        with ts.last_micro_batch():
            loss_of(model, x).backward()
            loss_of(model, x).backward()
    ts.close()


def test_checkpoint_refused_between_an_eager_backward_and_step():
    """After a last_micro_batch() backward some parameters have taken this step's update:
    state_dict()/load_state_dict() refuse until step(); then both work and the run
    continues as torch.optim.AdamW's."""
    ref_model, ts_model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters())
    ts = OffloadAdamW(ts_model.parameters(), threads=2)
    saved = ts.state_dict()
    x = batches(1)[0]
    with ts.last_micro_batch():
        loss_of(ts_model, x).backward()
    for call in (ts.state_dict, lambda: ts.load_state_dict(saved)):
        with pytest.raises(RuntimeError, match=r"between a last_micro_batch\(\) backward and step\(\)"):
            call()
    ts.step()
    loss_of(ref_model, x).backward()
    ref.step()
    assert_same(ref_model, ts_model)
    assert ts.state_dict()["state"][0]["step"].item() == 1.0
    ts.close()


@pytest.mark.parametrize("value", [0, -3, "many", True, 2.0])
def test_bad_eager_blocks_are_refused(value):
    with pytest.raises(ValueError, match="Invalid eager_blocks"):
        OffloadAdamW(make_model().parameters(), eager_blocks=value)


def test_worker_nice_reaches_the_engine():
    ts = OffloadAdamW(make_model().parameters(), threads=1)
    assert ts._engine.host._pool._nice == 5
    ts.close()
    ts = OffloadAdamW(make_model().parameters(), threads=1, worker_nice=19)
    assert ts._engine.host._pool._nice == 19
    ts.close()


@pytest.mark.parametrize("value", ["5", 5.0, None, False])
def test_bad_worker_nice_is_refused(value):
    with pytest.raises(ValueError, match="Invalid worker_nice"):
        OffloadAdamW(make_model().parameters(), worker_nice=value)


def test_engine_is_collected_and_its_workers_stop():
    from trainstream.core._engine import Engine
    from trainstream.backends.torch import TorchBackend

    old = set(threading.enumerate())
    engine = Engine(TorchBackend(torch.device("cpu")), threads=3)
    engine.add_param(torch.zeros(10), 10, "float32", "cpu")
    ours = [t for t in threading.enumerate() if t not in old]
    assert len(ours) == 3
    del engine
    gc.collect()
    for t in ours:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in ours)


def test_hooks_one_per_parameter():
    model = make_model()
    ts = OffloadAdamW(model.parameters(), threads=1)
    for x in batches(2):
        loss_of(model, x).backward()
        ts.step()
        ts.zero_grad()
    assert sum(rec.hook is not None for rec in ts._slots) == len(list(model.parameters()))
    ts.close()


def _two_orders_pair(steps, eager):
    """Two equal-width layers applied in an order that flips every other step: the hooks'
    firing order changes from one backward to the next."""
    def make():
        torch.manual_seed(3)
        return torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)])

    ref_m, ts_m = make(), make()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    ts = OffloadAdamW(ts_m.parameters(), lr=1e-2, threads=2)
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        x = torch.randn(4, 16, generator=g)
        order = (0, 1) if step % 2 == 0 else (1, 0)
        for m, opt, is_ts in ((ts_m, ts, True), (ref_m, ref, False)):
            y = x
            for i in order:
                y = torch.tanh(m[i](y))
            loss = y.square().mean()
            if is_ts and eager:
                with opt.last_micro_batch():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
    return ref_m, ts_m, ts


@pytest.mark.parametrize("eager", [False, True])
def test_hooks_whose_order_changes_between_steps(eager):
    ref_m, ts_m, ts = _two_orders_pair(6, eager)
    assert_same(ref_m, ts_m)
    assert sum(rec.hook is not None for rec in ts._slots) == 4  # one hook per parameter
    ts.close()


@pytest.mark.parametrize("kw", [dict(convention="torch"), dict(chunk_size=4096)])
def test_removed_arguments_are_refused(kw):
    """The torch adapter reproduces torch (no convention), and the engine keeps its work-item
    size (no chunk_size)."""
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        OffloadAdamW([nn.Parameter(torch.zeros(3))], **kw)


def test_placement_is_asked_once_of_the_core(monkeypatch):
    """One answer of the core's budget per registration (all groups at construction, then
    one per added group), which the engine takes without asking again."""
    from trainstream.core import _budget, _engine

    calls = []
    real = _budget.assign
    monkeypatch.setattr(_budget, "assign", lambda slots, *a, **k: calls.append(len(slots)) or real(slots, *a, **k))
    monkeypatch.setattr(_engine, "assign", lambda *a, **k: pytest.fail("the engine placed a slot itself"))
    model = make_model()
    groups = two_groups(model)
    ts = OffloadAdamW(groups[:1], threads=1)
    ts.add_param_group(groups[1])
    assert calls == [len(groups[0]["params"]), len(groups[1]["params"])]
    ts.close()
