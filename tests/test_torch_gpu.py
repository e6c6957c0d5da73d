"""OffloadAdamW with CUDA parameters (``cpu``, ``gpu``, ``hybrid`` modes): bit-identity with
torch.optim.AdamW on CUDA, no stale weights in the next forward, no optimizer state on the
GPU. (The loops of tests/test_torch_loops.py and the readiness flag of
tests/test_torch_readiness.py have their CUDA versions there.)"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from _torch_helpers import (  # noqa: E402
    assert_same,
    batches,
    chunked,
    loss_of,
    make_model,
    step_beside_master,
    train_pair,
    two_groups,
)

from trainstream.torch import OffloadAdamW  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def train_pair_cuda(steps=50, mode="cpu", **kw):
    """``train_pair`` of the CPU tests, on CUDA (engine threads: the default)."""
    ref_model, ts_model, ref, ts, _ = train_pair(steps, device=DEV, mode=mode, threads=None, **kw)
    return ref_model, ts_model, ref, ts


MODES = ["cpu", "gpu"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kw", [
    dict(), dict(sched=True), dict(micro=4), dict(max_norm=0.5), dict(micro=2, eager=True),
], ids=["groups", "scheduler", "accumulate4", "clip", "eager"])
def test_cuda_params_bit_identical(kw, mode):
    ref_model, ts_model, _, ts = train_pair_cuda(steps=50 if not kw else 30, mode=mode, **kw)
    assert_same(ref_model, ts_model)
    ts.close()


@pytest.mark.parametrize("mode", MODES + ["hybrid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_params_against_fp32_master(mode, dtype):
    model = make_model(dtype=dtype).to(DEV)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    with chunked(4096):
        ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, mode=mode, master_weights=True)
    for x in batches(30):
        x = x.to(DEV)
        step_beside_master(model, master, ref, ts, loss_of(model, x))
    ts.synchronize()
    sd = ts.state_dict()
    for sid, (p, m) in enumerate(zip(model.parameters(), master)):
        assert torch.equal(sd["state"][sid]["master_param"], m.detach().cpu())
        assert torch.equal(p.detach(), m.detach().to(dtype))
    ts.close()


def test_gpu_mode_equals_cpu_mode_and_norm_is_deterministic():
    runs = {}
    for mode in ("cpu", "gpu", "gpu"):
        ref_model, ts_model, _, ts = train_pair_cuda(steps=20, max_norm=0.5, mode=mode)
        runs.setdefault(mode, []).append((ts_model, ts.last_grad_norm()))
        ts.close()
    (g1, n1), (g2, n2) = runs["gpu"]
    assert n1 == n2  # same bits run after run
    assert_same(g1, g2)
    assert_same(runs["cpu"][0][0], g1)


def _run(m, opt, xs):
    for x in xs:
        opt.zero_grad()
        loss_of(m, x).backward()
        opt.step()
    opt.synchronize()


def _resume_in_another_mode(first, second, data, split):
    """Train in ``first`` mode, checkpoint after ``split`` batches, go on; a model and an
    optimizer in ``second`` mode restored from the checkpoint must land on the same bits."""
    model = make_model().to(DEV)
    ts = OffloadAdamW(two_groups(model), mode=first)
    _run(model, ts, data[:split])
    ck = copy.deepcopy({"model": model.state_dict(), "opt": ts.state_dict()})  # views, as torch's
    _run(model, ts, data[split:])
    m2 = make_model().to(DEV)
    m2.load_state_dict(ck["model"])
    ts2 = OffloadAdamW(two_groups(m2), mode=second)
    ts2.load_state_dict(ck["opt"])
    _run(m2, ts2, data[split:])
    assert_same(model, m2)
    return ts, m2, ts2


def test_checkpoint_moves_between_modes():
    data = [x.to(DEV) for x in batches(30)]
    ts, m2, ts2 = _resume_in_another_mode("cpu", "gpu", data, 15)
    m3 = make_model().to(DEV)
    m3.load_state_dict(m2.state_dict())
    ts3 = OffloadAdamW(two_groups(m3), mode="cpu")
    ts3.load_state_dict(ts2.state_dict())
    _run(m2, ts2, data[:5])
    _run(m3, ts3, data[:5])
    assert_same(m2, m3)
    for o in (ts, ts2, ts3):
        o.close()


def test_gpu_mode_needs_cuda_parameters():
    with pytest.raises(ValueError, match="needs CUDA parameters"):
        OffloadAdamW([nn.Parameter(torch.zeros(3))], mode="gpu")


class Thin(nn.Module):
    """Very low arithmetic density: many tiny layers, so uploads race the next forward."""

    def __init__(self, layers=96, d=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("mode,eager", [("cpu", False), ("cpu", True), ("gpu", False), ("gpu", True),
                                        ("hybrid-last", True)])
def test_no_stale_weights_in_next_forward(mode, eager):
    torch.manual_seed(0)
    ref_model = Thin().to(DEV)
    ts_model = Thin().to(DEV)
    ts_model.load_state_dict(ref_model.state_dict())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    kw = dict(mode="hybrid", gpu_params="last", gpu_share=0.5) if mode == "hybrid-last" else dict(mode=mode)
    ts = OffloadAdamW(ts_model.parameters(), lr=1e-2, threads=2, **kw)
    x = torch.randn(8, 16, device=DEV)
    for step in range(100):
        out_ref = ref_model(x)
        out_ts = ts_model(x)  # reads the weights uploaded by the previous step
        assert torch.equal(out_ref, out_ts), f"stale weights read at step {step}"
        out_ref.square().mean().backward()
        ref.step()
        ref.zero_grad()
        if eager:
            with ts.last_micro_batch():
                out_ts.square().mean().backward()
        else:
            out_ts.square().mean().backward()
        ts.step()
        ts.zero_grad()
    ts.close()


@pytest.mark.parametrize("mode", MODES)
def test_no_optimizer_state_or_gradient_on_gpu(mode):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = make_model().to(DEV)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ts = OffloadAdamW(model.parameters(), mode=mode)
    x = batches(1)[0].to(DEV)
    for _ in range(3):
        loss_of(model, x).backward()
        ts.step()
        ts.zero_grad()
    ts.synchronize()
    torch.cuda.synchronize()
    assert all(p.grad is None for p in model.parameters())
    extra = torch.cuda.memory_allocated() - base - param_bytes
    assert extra < 64 * 1024, f"{extra} bytes beyond the weights stay on the GPU"
    ts.close()


def test_copies_through_the_cuda_layer_bit_identical():
    """cpu mode's copies and events through trainstream._cuda (the one CUDA layer): the
    same weights as torch.optim.AdamW, eager path too."""
    ref_model, ts_model, _, ts = train_pair_cuda(steps=20, micro=2, eager=True)
    assert ts._engine.backend.drv is not None
    assert_same(ref_model, ts_model)
    ts.close()


def test_gradient_copy_waits_for_the_upload_from_its_staging():
    """bf16 weights are uploaded from the gradient's staging buffer: the next gradient
    copy into it, queued at once (no forward in between to order it), must not overwrite
    the weights the upload is still reading."""
    from trainstream import contract as C
    from trainstream.core._host import HostPlacement as Engine
    from trainstream.backends.torch import TorchBackend

    n = 1 << 24
    p = torch.randn(n, device=DEV).to(torch.bfloat16)
    backend = TorchBackend(DEV)
    eng = Engine(backend, threads=4, chunk_size=1 << 22)
    sid = eng.add_param(p, n, "bfloat16", "cuda")
    assert eng._slot(sid).param_stage is eng._slot(sid).grad_stage
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.0)
    for _ in range(3):
        # Hold the upload stream (~0.5 s of GPU sleep): the upload queued by the update
        # starts late, so a gradient copy that did not wait for it would land first and
        # the upload would send its 7s as weights.
        with torch.cuda.stream(backend.h2d):
            torch.cuda._sleep(1 << 30)
        eng.offload_grad(sid, torch.randn(n, device=DEV).to(torch.bfloat16), "bfloat16", update=hp)
        eng.offload_grad(sid, torch.full((n,), 7.0, device=DEV, dtype=torch.bfloat16), "bfloat16")
        eng.synchronize()
        master = torch.from_numpy(eng.state(sid)["master"])
        assert torch.equal(p.cpu(), master.to(torch.bfloat16))
        eng.discard_grads()
    eng.close()


def test_driver_copies_events_and_errors():
    from trainstream import _cuda as drv

    ctx = drv.Context(torch.cuda.current_device())
    stream = torch.cuda.Stream()
    src = torch.arange(1 << 20, dtype=torch.float32, device=DEV)
    host = torch.empty(1 << 20, dtype=torch.float32, pin_memory=True)
    back = torch.empty_like(src)
    after = drv.Event(ctx, torch.cuda.current_stream().cuda_stream)
    ctx.stream_wait_event(stream.cuda_stream, after)
    ctx.memcpy_dtoh_async(host.data_ptr(), src.data_ptr(), src.numel() * 4, stream.cuda_stream)
    landed = drv.Event(ctx, stream.cuda_stream)
    landed.synchronize()
    assert landed.query()
    assert torch.equal(host, src.cpu())
    host.mul_(2)
    ctx.memcpy_htod_async(back.data_ptr(), host.data_ptr(), src.numel() * 4, stream.cuda_stream)
    up = drv.Event(ctx, stream.cuda_stream)
    ctx.stream_wait_event(torch.cuda.current_stream().cuda_stream, up)
    assert torch.equal(back, src * 2)  # ordered on the compute stream by the wait
    with pytest.raises(drv.CudaDriverError, match="cuMemcpyHtoDAsync failed: CUDA_ERROR"):
        ctx.memcpy_htod_async(8, host.data_ptr(), 4, stream.cuda_stream)
        torch.cuda.synchronize()


def test_driver_calls_leave_the_threads_context_alone():
    """A driver call from a thread whose current context is another one (here: none)
    runs in the device's primary context and leaves the thread as it was."""
    import ctypes
    import threading

    from trainstream import _cuda as drv

    ctx = drv.Context(torch.cuda.current_device())
    stream = torch.cuda.Stream()
    seen = {}

    def worker():
        cur = ctypes.c_void_p()
        drv._fast.cuCtxGetCurrent(ctypes.byref(cur))
        seen["before"] = cur.value
        ev = drv.Event(ctx, stream.cuda_stream)
        ev.synchronize()
        seen["done"] = ev.query()
        drv._fast.cuCtxGetCurrent(ctypes.byref(cur))
        seen["after"] = cur.value

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["done"]
    assert seen["after"] == seen["before"]


@pytest.mark.parametrize("share", [0.05, 0.3])
@pytest.mark.parametrize("gpu_params", ["first", "last"])
def test_hybrid_placement_by_fit(gpu_params, share):
    """The GPU share takes the parameters that fit in what is left of it, from the first
    or from the last one; with 5% even the first parameter (1024 of 10624 elements)
    does not fit and stays on the host."""
    model = make_model().to(DEV)
    params = [p for g in two_groups(model) for p in g["params"]]
    ts = OffloadAdamW(two_groups(model), mode="hybrid", gpu_share=share, gpu_params=gpu_params)
    left = round(share * sum(p.numel() for p in params))
    want = [False] * len(params)
    for i in (range(len(params)) if gpu_params == "first" else range(len(params) - 1, -1, -1)):
        if params[i].numel() <= left:
            want[i], left = True, left - params[i].numel()
    assert [ts._engine.on_device(sid) for sid in range(len(params))] == want
    assert any(want) and not all(want)
    ts.close()


@pytest.mark.parametrize("kw", [dict(), dict(sched=True), dict(micro=4), dict(micro=2, eager=True),
                                dict(max_norm=0.5), dict(max_norm=0.5, micro=2)],
                         ids=["groups", "scheduler", "accumulate4", "eager", "clip", "clip-accumulate2"])
@pytest.mark.parametrize("gpu_params", ["first", "last"])
def test_hybrid_mode_bit_identical(kw, gpu_params):
    """mode='hybrid': 30% of the elements (the first or the last parameters) by the
    zero-copy kernel, the rest by the host threads: the same bits as torch.optim.AdamW on
    CUDA."""
    ref_model, ts_model, _, ts = train_pair_cuda(steps=30, mode="hybrid", gpu_params=gpu_params, **kw)
    assert_same(ref_model, ts_model)
    st = ts.stats()
    assert 0 < st["gpu_params"] < st["params"]
    on_gpu = [ts._engine.on_device(sid) for sid in range(int(st["params"]))]
    assert on_gpu[-1 if gpu_params == "last" else 0] and not on_gpu[0 if gpu_params == "last" else -1]
    if kw.get("eager"):  # "last": the GPU share's kernels launched by its gradient hooks
        want = 30 * st["gpu_params"] if gpu_params == "last" else 0  # "first": at step()
        assert ts._engine.device.stats()["eager_updates"] == want
    ts.close()


@pytest.mark.parametrize("mode", ["gpu", "hybrid"])
def test_eager_kernels_launch_during_backward(mode):
    """Under last_micro_batch() the zero-copy kernels start from the gradient hooks: the
    update is queued before step() (stats), a second backward in the block raises,
    zeroing gradients in place afterwards is ordered after the kernels that read them,
    and a capped grid (fewer blocks than the device holds) changes no bit."""
    kw = dict(gpu_params="last", gpu_share=0.5) if mode == "hybrid" else {}
    ref_model, ts_model, _, ts = train_pair_cuda(steps=20, mode=mode, micro=2, eager=True,
                                                 zero_to_none=False, eager_blocks=3, **kw)
    assert_same(ref_model, ts_model)
    assert ts._engine.eager_blocks == 3
    gpu = ts._engine.device
    gpu_sids = [sid for sid in range(len(ts._slots)) if ts._engine.on_device(sid)]
    assert len(gpu_sids) == gpu.stats()["params"] > 0
    before = gpu.stats()["eager_updates"]
    x = batches(1)[0].to(DEV)
    ts.zero_grad()
    with ts.last_micro_batch():
        loss_of(ts_model, x).backward(retain_graph=True)
    # Queued before step(), each gradient kept in param.grad (issue 42), each update awaited by
    # the next forward (and by an in-place zero_grad).
    assert gpu.stats()["eager_updates"] - before == len(gpu_sids)
    params = list(ts_model.parameters())
    assert all(params[sid].grad is not None for sid in gpu_sids)
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        ts.state_dict()
    with pytest.raises(RuntimeError, match="second backward inside last_micro_batch"):
        with ts.last_micro_batch():
            loss_of(ts_model, x).backward()
    ts.close()


def _record_launches(monkeypatch):
    """Wrap the launcher: [(param dtype, grad dtype, [n per tensor])] of the launches of
    several tensors or of none capped, and [n] of the capped launches of one tensor (the
    eager path's, from gradient hooks)."""
    import trainstream._device_kernels as dk
    import trainstream._device_recipes as dr

    multi, single = [], []
    real, real_torch = dk.launch_adamw_multi, dr.launch_torch_multi

    def record(pd, gd, ns, k):
        if k.get("max_blocks") is not None and len(ns) == 1:
            single.append(ns[0])
        else:
            multi.append((pd, gd, ns))

    def launch(variant, pd, gd, items, *a, **k):  # the fp32-master scheme without a recipe (JAX's)
        items = list(items)
        record(pd, gd, [it[5] for it in items], k)
        return real(variant, pd, gd, items, *a, **k)

    def launch_torch(recipe, gd, items, *a, **k):  # a torch recipe's kernels (every torch slot)
        items = list(items)
        record(recipe.dtype, dk._dtype_name(gd), [dr.TorchItem(*it).n for it in items], k)
        return real_torch(recipe, gd, items, *a, **k)

    monkeypatch.setattr(dk, "launch_adamw_multi", launch)
    monkeypatch.setattr(dr, "launch_torch_multi", launch_torch)
    return multi, single


@pytest.mark.parametrize("kw", [dict(), dict(max_norm=0.5)], ids=["plain", "clip"])
@pytest.mark.parametrize("mode", ["gpu", "hybrid"])
def test_step_launches_several_tensors_at_once(mode, kw, monkeypatch):
    """step() queues the zero-copy updates as multi-tensor launches: consecutive tensors,
    a launch closed once it holds MULTI_LAUNCH_ELEMS elements (3000 here, so that the tiny
    model takes several), and no launch per tensor; the weights stay bit-identical to
    torch.optim.AdamW (clipping: torch's clip_grad_norm_ on param.grad first, then c = 1)."""
    import trainstream.core._device as ge

    monkeypatch.setattr(ge, "MULTI_LAUNCH_ELEMS", 3000)
    multi, single = _record_launches(monkeypatch)
    extra = dict(gpu_share=0.6) if mode == "hybrid" else {}
    ref_model, ts_model, _, ts = train_pair_cuda(steps=8, mode=mode, **kw, **extra)
    assert_same(ref_model, ts_model)
    on_gpu = (lambda sid: True) if mode == "gpu" else ts._engine.on_device
    order = [p.numel() for g in ts.param_groups for p in g["params"] if on_gpu(ts._slots.of(p).sid)]
    assert single == []
    # every GPU-share tensor once per step, in the order step() lists them
    assert [n for _, _, ns in multi for n in ns] == order * 8
    assert any(len(ns) > 1 for _, _, ns in multi)
    for _, _, ns in multi:
        assert len(ns) == 1 or sum(ns) <= 3000  # the cap (a larger tensor alone)
    launches, per_step = [ns for _, _, ns in multi], []
    while launches:  # split the launches into steps, then check none closed too early
        k = next(i for i in range(1, len(launches) + 1)
                 if sum(len(ns) for ns in launches[:i]) == len(order))
        per_step.append(launches[:k])
        launches = launches[k:]
    for step in per_step:
        for a, b in zip(step, step[1:]):  # one dtype pair here: only the cap closes a launch
            assert sum(a) + b[0] > 3000, step
    ts.close()


def test_multi_launch_bits_equal_one_launch_per_tensor(monkeypatch):
    """Fifty tensors of two dtypes in runs of 10 fp32, 2 bf16, 34 fp32, 4 bf16: step()'s
    launches of at most MULTI_MAX tensors of one dtype pair each (10, 2, 32, 2, 4 per
    step); weights and state bit-equal to one launch per tensor (the eager path's: each
    gradient hook under last_micro_batch() launches its own tensor, on a capped grid)."""

    def build():
        torch.manual_seed(0)
        params = nn.ParameterList()
        for k in range(50):
            dtype = torch.bfloat16 if k in (10, 11) or k >= 46 else torch.float32
            params.append(nn.Parameter(torch.randn(7 + 13 * k, device=DEV).to(dtype)))
        return params

    def train(launch):
        params = build()
        opt = OffloadAdamW(params, lr=1e-2, weight_decay=0.1, mode="gpu", master_weights=True)
        for t in range(4):
            loss = sum(((p.float() - 0.1 * t) ** 2).sum() * (1 + k % 5) for k, p in enumerate(params))
            opt.zero_grad()
            if launch == "single":
                with opt.last_micro_batch():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
        opt.synchronize()
        sd = opt.state_dict()
        opt.close()
        return [p.detach().clone() for p in params], sd

    multi, single = _record_launches(monkeypatch)
    want, want_sd = train("single")
    assert len(single) == 4 * 50 and multi == []
    single.clear()
    got, got_sd = train("multi")
    assert single == []
    assert sum(len(ns) for _, _, ns in multi) == 4 * 50
    assert all(pd == gd for pd, gd, _ in multi)
    assert [len(ns) for _, _, ns in multi] == [10, 2, 32, 2, 4] * 4
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    for sid, st in want_sd["state"].items():
        for key, value in st.items():
            assert torch.equal(value, got_sd["state"][sid][key]), (sid, key)


def test_hybrid_checkpoint_moves_to_cpu_mode():
    ts, _, ts2 = _resume_in_another_mode("hybrid", "cpu", [x.to(DEV) for x in batches(20)], 10)
    for o in (ts, ts2):
        o.close()


# -- state resident in GPU memory (gpu_state_bytes) ---------------------------------------------

#: gpu_state_bytes for make_model()'s fp32 state in two_groups' order (1024, 3072, 1024, 2048,
#: 2048, 1024 weights, then nine biases): the first two weights and every bias fit (35840
#: bytes), the other four weights (6144 elements) go where the mode says (hybrid, 0.3 of them:
#: the 1024-element third weight by the zero-copy kernel, the rest on the host).
RESIDENT = 40000
RESIDENT_MASK = [True, True, False, False, False, False] + [True] * 9


@pytest.mark.parametrize("mode", ["cpu", "gpu", "hybrid", "hybrid-last"])
@pytest.mark.parametrize("kw", [{}, {"sched": True}, {"micro": 4}, {"max_norm": 0.5}, {"micro": 2, "eager": True}],
                         ids=["groups", "scheduler", "accumulate4", "clip", "eager"])
def test_resident_state_bit_identical(kw, mode):
    """A share of the state resident in GPU memory, the rest as the mode places it (host
    threads, zero-copy kernel, or both): the same bits as torch.optim.AdamW on CUDA; the
    resident share takes exactly the parameters that fit, in order, and is counted in
    stats(); state (host copies) equals torch's."""
    extra = {"mode": "hybrid", "gpu_params": "last"} if mode == "hybrid-last" else {"mode": mode}
    ref_model, ts_model, ref, ts = train_pair_cuda(steps=30, gpu_state_bytes=RESIDENT, **kw, **extra)
    assert_same(ref_model, ts_model)
    params = [p for g in ts.param_groups for p in g["params"]]
    assert [ts._engine.has_gpu_state(sid) for sid in range(len(params))] == RESIDENT_MASK
    st = ts.stats()
    assert st["gpu_state_params"] == 11 and st["gpu_state_bytes"] == 35840 and st["gpu_state_numel"] == 4480
    if mode == "gpu":
        assert st["host_state_bytes"] == 8 * 6144  # the mapped share only
    if mode.startswith("hybrid"):
        assert 0 < st["gpu_params"] - st["gpu_state_params"] < 4  # a zero-copy share beside the host's
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    for p, q in zip(params, ref_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ts.state[p][key], ref.state[q][key].cpu()), key
        assert int(ts.state[p]["step"]) == int(ref.state[q]["step"])
    ts.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_resident_half_params_against_fp32_master(mode, dtype):
    """fp16/bf16 weights with their fp32 master in GPU memory (12 bytes an element) for the
    parameters that fit: the bits of torch.optim.AdamW on an fp32 master; state_dict's
    master_param (a copy from GPU memory) equals that master."""
    model = make_model(dtype=dtype).to(DEV)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    with chunked(4096):
        ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, mode=mode, gpu_state_bytes=RESIDENT,
                          master_weights=True)
    resident = [ts._engine.has_gpu_state(sid) for sid in range(len(master))]
    assert any(resident) and not all(resident)
    assert ts.stats()["gpu_state_bytes"] == sum(12 * p.numel() for p, r in zip(master, resident) if r)
    for x in batches(30):
        x = x.to(DEV)
        step_beside_master(model, master, ref, ts, loss_of(model, x))
    sd = ts.state_dict()
    for sid, (p, m) in enumerate(zip(model.parameters(), master)):
        assert torch.equal(sd["state"][sid]["master_param"], m.detach().cpu())
        assert torch.equal(sd["state"][sid]["exp_avg"], ref.state[m]["exp_avg"].cpu())
        assert torch.equal(p.detach(), m.detach().to(dtype))
    ts.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu", "hybrid"])
@pytest.mark.parametrize("kw", [{}, {"max_norm": 0.5}, {"micro": 2, "eager": True}], ids=["groups", "clip", "eager"])
def test_auto_resident_state_bit_identical(kw, mode, monkeypatch):
    """gpu_state_bytes="auto" on a GPU that has RESIDENT bytes free beyond the tenth left free
    (mem_get_info reports that): after the first step the same parameters move into GPU memory
    as with gpu_state_bytes=RESIDENT, and all along the bits are torch.optim.AdamW's."""
    total = torch.cuda.mem_get_info(DEV)[1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (RESIDENT + int(0.1 * total) + 1, total))
    ref_model, ts_model, ref, ts = train_pair_cuda(steps=20, gpu_state_bytes="auto", mode=mode, **kw)
    assert_same(ref_model, ts_model)
    params = [p for g in ts.param_groups for p in g["params"]]
    assert [ts._engine.has_gpu_state(sid) for sid in range(len(params))] == RESIDENT_MASK
    st = ts.stats()
    assert st["gpu_state_params"] == 11 and st["gpu_state_bytes"] == 35840
    for p, q in zip(params, [p for g in ref.param_groups for p in g["params"]]):
        assert torch.equal(ts.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"].cpu())
    ts.close()


@pytest.mark.parametrize("mode", ["cpu", "gpu", "hybrid"])
def test_auto_resident_takes_the_free_gpu_memory_and_frees_the_host_state(mode):
    """gpu_state_bytes="auto" on the real GPU: offloaded until the first step, then all of this
    small model's state (bf16 weights: masters too) moves into GPU memory and its host memory is
    freed; the bits of torch.optim.AdamW on an fp32 master before and after, and in state_dict."""
    model = make_model(dtype=torch.bfloat16).to(DEV)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    with chunked(4096):
        ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, mode=mode, gpu_state_bytes="auto",
                          master_weights=True)
    st = ts.stats()
    assert st["gpu_state_params"] == 0 and st["gpu_state_bytes"] == 0 and st["host_state_bytes"] > 0
    for i, x in enumerate(batches(10)):
        step_beside_master(model, master, ref, ts, loss_of(model, x.to(DEV)))
        if i == 0:
            st = ts.stats()
            assert st["gpu_state_params"] == len(master) and st["host_state_bytes"] == 0
            assert st["gpu_state_bytes"] == sum(12 * p.numel() for p in master)
    sd = ts.state_dict()
    for sid, (p, m) in enumerate(zip(model.parameters(), master)):
        assert torch.equal(sd["state"][sid]["master_param"], m.detach().cpu())
        assert torch.equal(sd["state"][sid]["exp_avg"], ref.state[m]["exp_avg"].cpu())
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    ts.close()


def _run_any(m, opt, xs):
    for x in xs:
        opt.zero_grad()
        loss_of(m, x).backward()
        opt.step()


@pytest.mark.parametrize("mode", ["cpu", "hybrid"])
def test_resident_checkpoint_round_trip_with_adamw(mode):
    """torch.optim.AdamW's state_dict loaded into an optimizer with resident state (copied
    into GPU memory), and its state_dict (copies from GPU memory) loaded into
    torch.optim.AdamW: both go on with the bits of the uninterrupted torch run."""
    data = [x.to(DEV) for x in batches(30)]
    ref = make_model().to(DEV)
    ropt = torch.optim.AdamW(two_groups(ref))
    _run_any(ref, ropt, data[:10])
    m2 = make_model().to(DEV)
    m2.load_state_dict(ref.state_dict())
    ts = OffloadAdamW(two_groups(m2), mode=mode, gpu_state_bytes=RESIDENT)
    ts.load_state_dict(copy.deepcopy(ropt.state_dict()))
    for p, q in zip(m2.parameters(), ref.parameters()):
        assert torch.equal(ts.state[p]["exp_avg_sq"], ropt.state[q]["exp_avg_sq"].cpu())
    _run_any(ref, ropt, data[10:20])
    _run_any(m2, ts, data[10:20])
    assert_same(ref, m2)
    m3 = make_model().to(DEV)
    m3.load_state_dict(m2.state_dict())
    r3 = torch.optim.AdamW(two_groups(m3))
    r3.load_state_dict(copy.deepcopy(ts.state_dict()))
    _run_any(m2, ts, data[20:])
    _run_any(m3, r3, data[20:])
    _run_any(ref, ropt, data[20:])
    assert_same(ref, m2)
    assert_same(ref, m3)
    ts.close()


def test_resident_state_is_in_gpu_memory_and_close_frees_it():
    """gpu_state_bytes takes GPU memory outside torch's allocator at construction (counted in
    stats), none of host memory for those parameters; the update is torch's; close()
    gives the memory back."""
    n = 1 << 24  # 128 MiB of fp32 state, 192 MiB for bf16
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, device=DEV)), nn.Parameter(torch.randn(n, device=DEV).to(torch.bfloat16)),
              nn.Parameter(torch.randn(n, device=DEV))]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params[::2]]
    for p in params + ref_params:
        p.grad = torch.randn_like(p) * 1e-2
    budget = 8 * n + 12 * n
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    ts = OffloadAdamW(params, lr=1e-2, mode="gpu", gpu_state_bytes=budget + 1000, master_weights=True)
    free1 = torch.cuda.mem_get_info()[0]
    st = ts.stats()
    assert st["gpu_state_bytes"] == budget and st["gpu_state_params"] == 2 and st["host_state_bytes"] == 8 * n
    assert free0 - free1 >= budget
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    for p, q in zip(params[::2], ref_params):
        q.grad = p.grad.clone()
    for _ in range(2):
        ts.step()
        ref.step()
    for p, q in zip(params[::2], ref_params):  # one resident, one mapped
        assert torch.equal(p, q)
        assert torch.equal(ts.state[p]["exp_avg"], ref.state[q]["exp_avg"].cpu())
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    ts.close()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] - before >= budget - (16 << 20)


def test_resident_share_then_offloaded_gpu_share_in_hybrid():
    """hybrid's gpu_share counts the elements whose state is not resident: 0.5 of the four
    offloaded weights (3072 of 6144 elements) by fit from the first: the 1024 and 2048
    ones; the 2048 and 1024 after them on the host."""
    model = make_model().to(DEV)
    ts = OffloadAdamW(two_groups(model), mode="hybrid", gpu_share=0.5, gpu_state_bytes=RESIDENT)
    eng = ts._engine
    assert [eng.has_gpu_state(s) for s in range(15)] == RESIDENT_MASK
    assert [eng.on_device(s) and not eng.has_gpu_state(s) for s in range(6)] == [False, False, True, True, False, False]
    ts.close()


@pytest.mark.parametrize("mode", ["gpu", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_state_spans_ring_buffers_bit_identical(mode, dtype):
    """A 2.4M-element weight (more than one staging-ring buffer, 2**21 elements) beside
    small tensors, plain and eager (gradient hooks): the same bits as torch.optim.AdamW
    (bf16: against fp32 masters); the ring in stats (72 MiB; hybrid: none, zero-copy)."""
    import trainstream.core._ring as ge

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1200, 2000), nn.Tanh(), nn.Linear(2000, 3)).to(DEV, dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    extra = dict(gpu_share=0.9, gpu_params="first") if mode == "hybrid" else {}
    ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, mode=mode, master_weights=dtype != torch.float32,
                      **extra)
    assert model[0].weight.numel() > ge.RING_ELEMS
    for t in range(6):
        x = torch.randn(8, 1200, device=DEV, dtype=dtype)
        if t % 2:
            with ts.last_micro_batch():
                step_beside_master(model, master, ref, ts, model(x).float().square().mean())
        else:
            step_beside_master(model, master, ref, ts, model(x).float().square().mean())
    ts.synchronize()
    sd = ts.state_dict()
    for sid, (p, m) in enumerate(zip(model.parameters(), master)):
        assert torch.equal(p.detach(), m.detach().to(dtype))
        assert torch.equal(sd["state"][sid]["exp_avg"], ref.state[m]["exp_avg"].cpu())
    assert ts.stats()["staging_ring_bytes"] == (ge.RING_DEPTH * 3 * 4 * ge.RING_ELEMS if mode == "gpu" else 0)
    ts.close()
