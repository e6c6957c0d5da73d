"""Speculation (issue 42): host updates start during backward and ``step()`` commits or redoes them. Every loop
here runs beside the same loop with torch.optim.AdamW, calls a user makes with it only, and compares weights (and
the state at the end) bit for bit: clipping that applies on every step, on none, on alternating steps (the loop's
own ``clip_grad_norm_``, inside ``last_micro_batch()`` or not); GradScaler skips and inf gradients; accumulation 1
and 4 with and without the hint; a gradient edited in place, dropped, or the learning rate changed between
backward and ``step()``; state read between them. CPU (GradScaler("cpu")); fast."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from trainstream.torch import OffloadAdamW  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)
RECIPES = {"fp32": dict(), "fused": dict(fused=True), "amsgrad": dict(amsgrad=True), "bf16": dict(dtype=torch.bfloat16),
           "bf16-master": dict(dtype=torch.bfloat16, master_weights=True)}


def mlp(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device, dtype)


def batches(n, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=g).to(device) for _ in range(n)]


def loss_fn(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def same_state(ropt, opt, ref, ours):
    for p, q in zip(ref.parameters(), ours.parameters()):
        for key, want in ropt.state[p].items():
            assert torch.equal(torch.as_tensor(want).float().cpu(), torch.as_tensor(opt.state[q][key]).float().cpu()), key


def make(recipe="fp32", lr=1e-2, device="cpu", **kw):
    kw = {**RECIPES[recipe], **kw}
    dtype, master = kw.pop("dtype", torch.float32), kw.pop("master_weights", False)
    torch_kw = {k: v for k, v in kw.items() if k in ("fused", "amsgrad")}
    ref, ours = mlp(dtype, device), mlp(dtype, device)
    if master:  # the fp32-master scheme's reference: AdamW on fp32 copies (tests/test_torch_loops.py's)
        pytest.skip("master_weights=True's reference is its own (test_torch_loops.py); here: not speculated")
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1, **torch_kw)
    opt = OffloadAdamW(ours.parameters(), lr=lr, weight_decay=0.1, threads=1, **kw)
    return ref, ropt, ours, opt


def run_step(m, o, xs, hint, between=None):
    """One step of ``len(xs)`` micro-batches (the last inside ``last_micro_batch()`` with ``hint``), then
    ``between(m, o)`` (what the loop does between backward and step), step, zero_grad."""
    for i, x in enumerate(xs):
        loss = loss_fn(m, x) / len(xs)
        if hint and i == len(xs) - 1 and isinstance(o, OffloadAdamW):
            with o.last_micro_batch():
                loss.backward()
        else:
            loss.backward()
    out = between(m, o) if between is not None else None
    o.step()
    o.zero_grad()
    return out


def clip_to(factor):
    """``between``: clip_grad_norm_ with max_norm = factor times the norm (>= 1: the factor is exactly 1.0)."""
    def between(m, o):
        norm = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
        return float(torch.nn.utils.clip_grad_norm_(m.parameters(), float(norm) * factor))
    return between


CLIP_CASES = [("fp32", p) for p in ("every", "none", "alternating")] + [(r, "alternating") for r in ("fused", "amsgrad",
                                                                                                  "bf16")]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("recipe,pattern", CLIP_CASES, ids=[f"{r}-{p}" for r, p in CLIP_CASES])
@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_clipping_every_none_alternating(recipe, hint, pattern, device):
    """The loop's own clip_grad_norm_ (torch's norm, inside last_micro_batch() too); a factor of exactly 1.0
    commits the speculative update, a smaller one redoes it."""
    ref, ropt, ours, opt = make(recipe, device=device)
    clipped = {"every": [True] * 4, "none": [False] * 4, "alternating": [i % 2 == 0 for i in range(4)]}[pattern]
    for x, clip in zip(batches(4, device=device), clipped):
        between = clip_to(0.5 if clip else 2.0)
        norms = [run_step(m, o, [x], hint and o is opt, between) for m, o in ((ref, ropt), (ours, opt))]
        assert norms[0] == norms[1] and norms[0] > 0
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert st["spec_steps_redone"] == sum(clipped)
    assert st["spec_steps_committed"] == len(clipped) - sum(clipped)
    assert st["spec_backup_bytes"] > 0
    opt.close()


def test_clip_inside_last_micro_batch_returns_torchs_norm():
    """Issue 42's case: clip_grad_norm_(params, 1e-3) inside last_micro_batch() returned 0.0 and clipped nothing."""
    ref, ropt, ours, opt = make()
    for x in batches(3):
        loss_fn(ref, x).backward()
        with opt.last_micro_batch():
            loss_fn(ours, x).backward()
        assert all(p.grad is not None for p in ours.parameters())
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
        assert torch.equal(torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3), want)
        ropt.step()
        opt.step()
        ropt.zero_grad()
        opt.zero_grad()
        same(ref, ours)
    assert opt.stats()["spec_steps_redone"] == 3
    opt.close()


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_accumulation(micro, hint, device):
    """Accumulation 1 and 4, with and without the hint: without it the first step guesses one backward (rolled
    back at the second), later steps speculate at the fourth."""
    ref, ropt, ours, opt = make(device=device)
    xs = batches(3 * micro, device=device)
    for i in range(3):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, xs[i * micro:(i + 1) * micro], hint and o is opt, clip_to(2.0))
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    # The first step's first backward is taken for the last (rolled back at the second); without the hint that
    # step then has no speculation, with it the hinted backward is.
    assert st["spec_steps_committed"] == 3 - (micro > 1 and not hint)
    assert st["spec_rolled_back"] == (len(list(ours.parameters())) if micro > 1 else 0)
    opt.close()


def test_accumulation_stages_the_last_micro_batch_only():
    """With 4 micro-batches a step, once the first step showed 4 backwards, only the fourth's gradient is copied to
    the host (the first three would be summed into param.grad after): one gradient's bytes a step, torch's bits."""
    ref, ropt, ours, opt = make()
    grad_bytes = 4 * sum(p.numel() for p in ours.parameters())
    xs, sent = batches(12), []
    for i in range(3):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, xs[4 * i:4 * i + 4], False)
        same(ref, ours)
        sent.append(opt.stats()["grad_bytes_offloaded"])
    assert sent[2] - sent[1] == sent[1] - sent[0] == grad_bytes, sent
    opt.close()


def _edit(kind):
    def between(m, o):
        ps = list(m.parameters())
        if kind == "mul":
            ps[2].grad.mul_(0.5)
        elif kind == "add":
            ps[0].grad.add_(1e-3)
        elif kind == "mul_one":  # moves the version, not the bits: committed
            ps[0].grad.mul_(1.0)
        elif kind == "replace":
            ps[1].grad = ps[1].grad.clone() * 2
        elif kind == "drop":
            ps[3].grad = None
        elif kind == "zero_grad":
            m.zero_grad()
        elif kind == "zero_grad_in_place":
            o.zero_grad(set_to_none=False)
        elif kind == "lr":
            for g in o.param_groups:
                g["lr"] *= 0.5
        elif kind == "weight":
            with torch.no_grad():
                ps[0].mul_(0.9)
        elif kind == "state_dict":
            o.state_dict()
    return between


CHANGES = [(k, False) for k in ("mul", "add", "mul_one", "replace", "drop", "zero_grad", "zero_grad_in_place", "lr",
                                 "weight", "state_dict")] + [(k, True) for k in ("mul", "mul_one", "drop", "lr")]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("kind,hint", CHANGES, ids=[f"{k}-{'hint' if h else 'plain'}" for k, h in CHANGES])
def test_changes_between_backward_and_step(kind, hint, device):
    """A gradient edited in place, replaced or dropped, all gradients zeroed, the learning rate or a weight
    changed, the state read, between backward and step(): torch's bits (redone where it matters)."""
    ref, ropt, ours, opt = make(device=device)
    for x in batches(2, device=device):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], hint and o is opt, _edit(kind))
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    if kind == "mul_one":
        assert st["spec_steps_committed"] == 2 and st["spec_rolled_back"] == 0
    else:
        assert st["spec_rolled_back"] >= 2 and st["spec_steps_committed"] == 0
    opt.close()

def scaler_loop(ref, ropt, ours, opt, device, flow, each=None):
    """8 GradScaler steps of both pairs (an inf loss at step 2, a NaN gradient at step 5; ``flow`` "unscale_clip":
    unscale_ and clip_grad_norm_ before step), the scales and weights compared after each; ``each()`` after each."""
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=100) for _ in range(2)]
    for i, x in enumerate(batches(8, device=device)):
        for m, o, sc in ((ref, ropt, scalers[0]), (ours, opt, scalers[1])):
            loss = loss_fn(m, x)
            if i == 2:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            if i == 5:
                next(m.parameters()).grad[0, 0] = float("nan")
            if flow == "unscale_clip":
                sc.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 10.0)
            sc.step(o)
            sc.update()
            o.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        same(ref, ours)
        if each is not None:
            each()



@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("recipe", ["fp32", "fused", "bf16"])
@pytest.mark.parametrize("flow", ["plain", "unscale_clip"])
def test_grad_scaler_skips_and_inf_gradients(recipe, flow, device):
    """GradScaler("cpu"): scaled backward, step (or unscale_ and clip first), update; an inf loss on step 2 and a NaN
    gradient on step 5 skip those steps exactly as torch skips them (speculative work discarded). Speculation
    assumes the scale last seen (or, after unscale_, found): the steps where it is unchanged commit."""
    if device == "cuda" and recipe == "bf16":
        pytest.skip("torch's CUDA GradScaler does not unscale bf16 gradients")
    ref, ropt, ours, opt = make(recipe, device=device)
    scaler_loop(ref, ropt, ours, opt, device, flow)
    same_state(ropt, opt, ref, ours)
    assert int(opt.state[next(ours.parameters())]["step"]) == 6
    st = opt.stats()
    # scales 1024, 1024, (inf), 512, 512, (NaN), 256, 256: steps 1, 4 and 7 assume the scale they get
    assert (st["spec_steps_committed"], st["spec_steps_redone"]) == (3, 5)
    opt.close()


def test_speculate_false_and_the_budget():
    """speculate=False: updates at step() (no copies); a bad value is refused; the default speculates where the
    kept copies fit."""
    with pytest.raises(ValueError, match="Invalid speculate"):
        OffloadAdamW(mlp().parameters(), speculate="yes")
    for spec in (False, None):
        ref, ropt, ours, opt = make(speculate=spec)
        for x in batches(2):
            for m, o in ((ref, ropt), (ours, opt)):
                run_step(m, o, [x], False)
        same(ref, ours)
        st = opt.stats()
        assert (st["spec_updates"] > 0) == (spec is None)
        assert st["spec_backup_bytes"] == (0 if spec is False else 4 * 3 * sum(p.numel() for p in ours.parameters()))
        opt.close()


@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_a_failed_speculative_update_reaches_step_and_a_reload_continues(hint, monkeypatch):
    """Every host kernel raises during backward: step() raises the worker's error, the weights are the pre-step
    ones (nothing uploaded), and after load_state_dict the loop goes on with torch's bits."""
    from trainstream import _host_kernels as K
    from trainstream.core import WorkerError

    ref, ropt, ours, opt = make()
    saved, before = opt.state_dict(), [p.detach().clone() for p in ours.parameters()]
    real = K.adamw_chunk

    def boom(*args, **kwargs):
        raise FloatingPointError("injected")
    monkeypatch.setattr(K, "adamw_chunk", boom)
    with pytest.raises(WorkerError, match="injected"):
        run_step(ours, opt, batches(1), hint)
        opt.synchronize()
    monkeypatch.setattr(K, "adamw_chunk", real)
    for p, b in zip(ours.parameters(), before):
        assert torch.equal(p, b)
    opt.load_state_dict(saved)
    opt.zero_grad()
    for x in batches(2, seed=3):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], hint and o is opt)
        same(ref, ours)
    opt.close()


@pytest.mark.parametrize("spec", [None, True])
def test_the_budget_decides_where_the_user_does_not(spec, monkeypatch):
    """Where the kept copies do not fit the host memory left after host_margin, speculate=None warns once and updates
    at step(); speculate=True speculates anyway."""
    from trainstream.core import _budget

    monkeypatch.setattr(_budget, "speculation_fits", lambda nbytes, margin=None: False)
    ref, ropt, ours, opt = make(speculate=spec)
    with pytest.warns(RuntimeWarning, match="speculate=True takes the memory") if spec is None else _no_warning():
        for x in batches(2):
            for m, o in ((ref, ropt), (ours, opt)):
                run_step(m, o, [x], False)
    same(ref, ours)
    assert (opt.stats()["spec_updates"] > 0) == bool(spec)
    opt.close()


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            yield
    return ctx()


def _clip_via(how, factor, max_norm):
    """``between``: torch's clip_grad_norm_ for torch's optimizer; for ours opt.clip_grad_norm() (``how`` "method",
    max_norm = factor times the norm), or nothing (max_grad_norm= clips inside step())."""
    def between(m, o):
        if how != "method" and isinstance(o, OffloadAdamW):
            return None
        n = max_norm if how != "method" else float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
        n = n if how != "method" else n * factor
        if isinstance(o, OffloadAdamW):
            return float(o.clip_grad_norm(n, parameters=m.parameters()))
        return float(torch.nn.utils.clip_grad_norm_(m.parameters(), n))
    return between


@pytest.mark.parametrize("how", ["method", "max_grad_norm_small", "max_grad_norm_large"])
@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_clipping_through_the_optimizer(how, hint):
    """opt.clip_grad_norm() (alternating factors) and max_grad_norm= (clipping every step, or never): the factor is
    known without a bitwise check; 1.0 commits, less redoes, torch's norm and bits."""
    max_norm = {"max_grad_norm_small": 1e-4, "max_grad_norm_large": 1e4}.get(how)
    ref, ropt, ours, opt = make(max_grad_norm=max_norm)
    for i, x in enumerate(batches(4)):
        between = _clip_via(how, 0.5 if i % 2 == 0 else 2.0, max_norm)
        norms = [run_step(m, o, [x], hint and o is opt, between) for m, o in ((ref, ropt), (ours, opt))]
        if how == "method":
            assert norms[0] == norms[1]
        same(ref, ours)
    st = opt.stats()
    redone = {"method": 2, "max_grad_norm_small": 4, "max_grad_norm_large": 0}[how]
    assert (st["spec_steps_redone"], st["spec_steps_committed"]) == (redone, 4 - redone)
    opt.close()


def test_state_seen_between_backward_and_step_is_the_pre_step_state():
    """len(opt.state), ``p in opt.state`` and a state entry read between backward and step() are torch's (the
    speculative update is never what a read sees); the step goes on to torch's bits."""
    ref, ropt, ours, opt = make()
    for x in batches(3):
        seen = []
        for m, o in ((ref, ropt), (ours, opt)):
            def between(m, o):
                p = next(m.parameters())
                entry = {k: torch.as_tensor(v).float().clone() for k, v in o.state[p].items()} if p in o.state else {}
                seen.append((len(o.state), p in o.state, entry))
            run_step(m, o, [x], False, between)
        assert seen[0][:2] == seen[1][:2]
        assert seen[0][2].keys() == seen[1][2].keys()
        for k in seen[0][2]:
            assert torch.equal(seen[0][2][k], seen[1][2][k]), k
        same(ref, ours)
    opt.close()


def _copies_ahead_done(opt, timeout=30.0):
    """Wait until the engine's copies taken ahead (after a step that speculated) have all run."""
    import time

    from trainstream.core._hostslot import COPIED

    t = time.monotonic()
    for s in opt._engine.host._slots:
        while s.pre is not None and (not s.pre.queued or any(c != COPIED for c in s.pre.chunks)):
            assert time.monotonic() - t < timeout
            time.sleep(0.001)


@pytest.mark.parametrize("edit", ["kept-view", "fresh-view", "none"])
def test_state_changed_in_place_after_the_copies_ahead(edit):
    """The copies of the next step's pre-step state are taken ahead, after step(); the state changed in place
    after that (a view held since an earlier step, or a new one) is what a rollback restores: torch's bits."""
    ref, ropt, ours, opt = make()
    xs = batches(6)
    kept = None
    for i, x in enumerate(xs):
        clip = i in (3, 5)  # redone: restored from the copies
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False, clip_to(0.5 if clip else 2.0))
        if i == 1 and edit == "kept-view":
            kept = (ropt.state[next(ref.parameters())]["exp_avg"], opt.state[next(ours.parameters())]["exp_avg"])
        if i in (2, 4) and edit != "none":
            _copies_ahead_done(opt)  # taken (where they are) before the change
            if edit == "kept-view":
                for t in kept:
                    t.mul_(0.5)
            else:
                for o, m in ((ropt, ref), (opt, ours)):
                    o.state[next(m.parameters())]["exp_avg_sq"].mul_(2.0)
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert st["spec_steps_redone"] == 2 and st["precopy_ms_total"] > 0
    opt.close()


@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_state_views_held_and_changed_between_backward_and_step(hint):
    """A view of the state held since an earlier step and changed between backward and ``step()`` (torch's step
    reads the change): the held parameter's update waits for ``step()``, the others' still start during backward;
    torch's bits."""
    ref, ropt, ours, opt = make()
    held = {}
    for i, x in enumerate(batches(5)):
        for m, o in ((ref, ropt), (ours, opt)):
            def between(m, o):
                if held:
                    held[o is opt]["exp_avg"].mul_(0.5)
            run_step(m, o, [x], hint and o is opt, between)
        if i == 0:
            held = {o is opt: o.state[next(m.parameters())] for m, o in ((ref, ropt), (ours, opt))}
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    opt.close()


@pytest.fixture
def gradient_state():
    """Accelerate's GradientState (as HF Trainer and accelerator.accumulate set it), restored afterwards."""
    state = pytest.importorskip("accelerate.state")
    shared = state.GradientState._shared_state
    was = dict(shared)
    try:
        yield state.GradientState()
    finally:  # Accelerate's state as it was (other tests of this process)
        shared.clear()
        shared.update(was)


@pytest.mark.parametrize("between", ["none", "clip", "forward", "state_dict", "zero_grad"])
def test_accelerates_gradient_state_says_which_micro_batch_is_the_last(gradient_state, between):
    """Accumulation 4 signalled through Accelerate's GradientState: the fourth backward speculates from the first
    step on, nothing is rolled back at the hooks, and its weights are uploaded during that backward (as under
    last_micro_batch()). Between backward and step(): the loop's clip (factor 1.0, committed), a forward (a module
    forward rolls the uploaded updates back first: it sees the old weights, as torch's; step() redoes them), the
    state read, zero_grad: torch's bits."""
    ref, ropt, ours, opt = make()
    xs = batches(16)
    for i in range(4):
        outs = []
        for m, o in ((ref, ropt), (ours, opt)):
            before = [p.detach().clone() for p in m.parameters()]
            for j, x in enumerate(xs[4 * i:4 * i + 4]):
                gradient_state._set_sync_gradients(j == 3)
                (loss_fn(m, x) / 4).backward()
            if o is opt:
                opt._engine.drain()  # (the host updates run on worker threads)
                moved = [not torch.equal(p, b) for p, b in zip(m.parameters(), before)]
                assert all(moved), "uploaded during the last backward"
            if between == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
            elif between == "forward":
                with torch.no_grad():
                    outs.append(m(xs[0]))
            elif between == "state_dict":
                o.state_dict()
            elif between == "zero_grad":
                o.zero_grad()
            o.step()
            o.zero_grad()
        if outs:
            assert torch.equal(outs[0], outs[1])
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    redone = between in ("forward", "state_dict", "zero_grad")
    assert st["spec_rolled_back"] == (4 * len(list(ours.parameters())) if redone else 0)
    assert (st["spec_steps_committed"], st["spec_steps_redone"]) == ((0, 4) if between in ("forward", "state_dict")
                                                                     else (4, 0) if not redone else (0, 0))
    assert opt._grads._guard is None
    opt.close()


def test_a_second_backward_after_accelerates_last_micro_batch_raises(gradient_state):
    """Two backwards on one forward (retain_graph) in the micro-batch Accelerate marks as the last: the second read
    the weights uploaded during the first; refused (its weights rolled back), as a second backward inside
    last_micro_batch()."""
    ref, ropt, ours, opt = make()
    x = batches(1)[0]
    gradient_state._set_sync_gradients(False)
    loss_fn(ours, x).backward()
    gradient_state._set_sync_gradients(True)
    before = [p.detach().clone() for p in ours.parameters()]
    loss = loss_fn(ours, x)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward after the one Accelerate's gradient state marked"):
        loss.backward()
    opt.synchronize()
    for p, b in zip(ours.parameters(), before):
        assert torch.equal(p, b)
    opt.close()


@pytest.mark.parametrize("impl", ["forloop", "foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("maximize", [False, True])
def test_nan_and_inf_gradients_as_torch(impl, dtype, maximize):
    """NaN and inf gradients, and a clip by a NaN norm, propagate as torch's: NaN where torch has NaN, every other
    bit torch's; a NaN's own bits (sign, payload) are not promised (docs/exactness.md: x86 keeps an operand's NaN,
    and which operand the compiled kernels hand on is LLVM's choice)."""
    kw = {"forloop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, 40).to(dtype)) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ropt = torch.optim.AdamW(ps, lr=1e-2, maximize=maximize, **kw)
    opt = OffloadAdamW(qs, lr=1e-2, maximize=maximize, threads=1, **kw)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan_neg = -torch.tensor([float("nan")])  # the sign bit set
    for step in range(4):
        for group in (ps, qs):
            for k, p in enumerate(group):
                g = torch.linspace(-0.5, 0.5, 40) * (step + 1)
                if step >= 1 and k == 0:
                    g[3], g[7], g[11] = float("nan"), nan_neg[0], float("inf")
                p.grad = g.to(dtype)
            if step == 3:  # the norm is NaN: every gradient times a NaN
                torch.nn.utils.clip_grad_norm_(group, 1.0)
        ropt.step()
        opt.step()
        for p, q in zip(ps, qs):
            a, b = p.detach(), q.detach()
            assert torch.equal(a.isnan(), b.isnan()), step
            a, b = torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b)
            assert torch.equal(a.view(bits), b.view(bits)), (step, p, q)
        assert step == 0 or ps[0].isnan().any()  # the case is exercised
    opt.close()
