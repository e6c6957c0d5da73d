"""Weight shadows (``weight_shadows``, issue 42): in a plain loop (no ``last_micro_batch()``, no Accelerate signal) a
speculative update uploads its new weights during backward into a device buffer shaped as the parameter, and
``step()`` commits them with one device copy instead of an upload over PCIe. Every loop runs beside the same loop with
torch.optim.AdamW and compares bit for bit: clipping on every step, on none, alternating; a read of the weights
between backward and ``step()`` sees the old ones; GradScaler skips and inf gradients, a wrong guess of
accumulation, ``zero_grad()`` and ``load_state_dict()`` before ``step()`` drop the shadows with the parameters
untouched; the memory decision and the user's choice. On the CPU the path is forced through its private seam
(``_gradcopy.SHADOW_DEVICES``); the ``gpu`` tests run the real CUDA path (no seam)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from test_torch_speculate import batches, clip_to, loss_fn, make, run_step, same, same_state, scaler_loop  # noqa: E402

from trainstream.torch import OffloadAdamW  # noqa: E402
from trainstream.torch import _gradcopy  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")])


@pytest.fixture
def shadows_on(monkeypatch):
    """CPU parameters get shadows too (the seam); returns the weak references to every shadow kept."""
    monkeypatch.setattr(_gradcopy, "SHADOW_DEVICES", frozenset({"cpu", "cuda"}))
    refs = []
    keep = _gradcopy.WeightShadows.keep

    def tracked(self, sid, t, need):
        buf = keep(self, sid, t, need)
        if buf is not None:
            refs.append(weakref.ref(buf))
        return buf
    monkeypatch.setattr(_gradcopy.WeightShadows, "keep", tracked)
    return refs


def _released(opt, refs):
    assert len(opt._grads.shadows) == 0 and opt._grads.shadows.held == 0
    if any(r() is not None for r in refs):
        gc.collect()
        assert all(r() is None for r in refs), "a weight shadow outlived step()"


def _bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


CLIP_CASES = [("fp32", p) for p in ("every", "none", "alternating")] + [(r, "alternating") for r in
                                                                        ("fused", "amsgrad", "bf16")]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("recipe,pattern", CLIP_CASES, ids=[f"{r}-{p}" for r, p in CLIP_CASES])
def test_plain_loop_commits_through_shadows(shadows_on, recipe, pattern, device):
    """A plain loop clipping on every step (redone), none or alternating steps: every speculated update's weights go
    to a shadow; a read of the weights after backward (the updates finished) sees the old ones; torch's bits after
    each step, the shadows gone."""
    ref, ropt, ours, opt = make(recipe, device=device, weight_shadows=None if device == "cpu" else True)
    clipped = {"every": [True] * 4, "none": [False] * 4, "alternating": [i % 2 == 0 for i in range(4)]}[pattern]
    for x, clip in zip(batches(4, device=device), clipped):
        loss_fn(ref, x).backward()
        clip_to(0.5 if clip else 2.0)(ref, ropt)
        ropt.step()
        ropt.zero_grad()
        before = [p.detach().clone() for p in ours.parameters()]
        loss_fn(ours, x).backward()
        opt._engine.host.drain()  # every speculative update has run and uploaded where it uploads
        for p, b in zip(ours.parameters(), before):
            assert torch.equal(p, b), "a read before step() saw a speculative update's weights"
        clip_to(0.5 if clip else 2.0)(ours, opt)
        opt.step()
        opt.zero_grad()
        same(ref, ours)
        _released(opt, shadows_on)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert st["spec_shadowed"] == st["spec_updates"] > 0 and st["spec_uploads_early"] == 0
    assert st["spec_shadow_peak_bytes"] == _bytes(ours)
    assert (st["spec_steps_redone"], st["spec_steps_committed"]) == (sum(clipped), 4 - sum(clipped))
    opt.close()


@pytest.mark.parametrize("recipe,flow", [("fp32", "plain"), ("fp32", "unscale_clip"), ("fused", "unscale_clip")])
def test_grad_scaler_skips_drop_the_shadows(shadows_on, recipe, flow):
    """GradScaler: an inf loss and a NaN gradient skip their steps as torch skips them; the shadows are dropped with
    the parameters untouched."""
    ref, ropt, ours, opt = make(recipe)
    scaler_loop(ref, ropt, ours, opt, "cpu", flow, lambda: _released(opt, shadows_on))
    same_state(ropt, opt, ref, ours)
    assert opt.stats()["spec_shadowed"] > 0
    opt.close()


def test_a_wrong_guess_of_accumulation(shadows_on):
    """One backward per step, then four, then one: the second backward of the accumulating step rolls the first's
    speculation (its shadow) back; torch's bits."""
    ref, ropt, ours, opt = make()
    xs = batches(8)
    for xb in (xs[:1], xs[1:2], xs[2:6], xs[6:7], xs[7:8]):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, xb, False, clip_to(2.0))
        same(ref, ours)
        _released(opt, shadows_on)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert st["spec_rolled_back"] > 0 and st["spec_shadowed"] > 0
    opt.close()


@pytest.mark.parametrize("how", ["zero_grad", "load_state_dict", "forward"])
def test_between_backward_and_step(shadows_on, how):
    """zero_grad() or load_state_dict() between backward and step() drop the shadows (the parameters keep the old
    weights); a forward there reads the old weights; the loop goes on with torch's bits."""
    ref, ropt, ours, opt = make()
    saved, outs = {}, {}
    for i, x in enumerate(batches(4)):
        for m, o in ((ref, ropt), (ours, opt)):
            def between(m, o):
                if i != 2:
                    return
                if isinstance(o, OffloadAdamW):
                    o._engine.host.drain()
                    assert len(o._grads.shadows) == len(list(m.parameters()))
                if how == "zero_grad":
                    o.zero_grad()
                elif how == "load_state_dict":
                    o.load_state_dict(saved[o])
                else:
                    with torch.no_grad():
                        outs[o] = m(x)
                if isinstance(o, OffloadAdamW) and how != "forward":
                    _released(o, shadows_on)
            run_step(m, o, [x], False, between)
            if i == 0:
                saved[o] = copy.deepcopy(o.state_dict())
        same(ref, ours)
    if how == "forward":
        assert torch.equal(outs[ropt], outs[opt])
    same_state(ropt, opt, ref, ours)
    opt.close()


def test_the_hint_and_accelerate_upload_directly(shadows_on):
    """Inside last_micro_batch() the weights go to the parameters during backward (no shadow)."""
    ref, ropt, ours, opt = make()
    for x in batches(3):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], o is opt)
        same(ref, ours)
    assert opt.stats()["spec_shadowed"] == 0 and not shadows_on
    opt.close()


def test_the_memory_decides_where_the_user_does_not(shadows_on, monkeypatch):
    """weight_shadows=None: shadows where the device's free memory less a tenth of its total holds them (with the
    gradient copies' and the gradients not allocated yet), else uploads at step() with one warning; True keeps
    them anyway, False never; torch's bits each way."""
    monkeypatch.setattr(_gradcopy, "device_memory", lambda device: (1000, 10_000))
    for choice in (None, True, False):
        ref, ropt, ours, opt = make(weight_shadows=choice)
        ctx = pytest.warns(RuntimeWarning, match="weight_shadows=True keeps the shadows") if choice is None else None
        if ctx is not None:
            ctx.__enter__()
        for x in batches(3):
            for m, o in ((ref, ropt), (ours, opt)):
                run_step(m, o, [x], False, clip_to(2.0))
            same(ref, ours)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        st = opt.stats()
        assert (st["spec_shadowed"] > 0) == bool(choice)
        opt.close()
    seen = []
    monkeypatch.setattr(_gradcopy, "device_memory", lambda device: seen.append(device) or (10 ** 9, 10 ** 9))
    ref, ropt, ours, opt = make()
    for x in batches(3):
        run_step(ours, opt, [x], False)
    assert opt.stats()["spec_shadowed"] > 0 and len(seen) == 1  # decided once
    opt.close()


def test_an_out_of_memory_shadow_falls_back(shadows_on, monkeypatch):
    """A shadow the allocator cannot give: shadows released, a warning, the weights uploaded at step(); torch's
    bits."""
    ref, ropt, ours, opt = make()
    real = torch.empty_like
    for i, x in enumerate(batches(3)):
        run_step(ref, ropt, [x], False)
        if i == 1:
            calls = []

            def empty_like(t, *a, **k):
                calls.append(1)
                if len(calls) == 2:
                    raise torch.cuda.OutOfMemoryError("injected")
                return real(t, *a, **k)
            monkeypatch.setattr(torch, "empty_like", empty_like)
            with pytest.warns(RuntimeWarning, match="out of GPU memory for GPU shadows"):
                loss_fn(ours, x).backward()
            monkeypatch.setattr(torch, "empty_like", real)
            opt.step()
            opt.zero_grad()
        else:
            run_step(ours, opt, [x], False)
        same(ref, ours)
        _released(opt, shadows_on)
    assert opt.stats()["spec_steps_committed"] == 3
    opt.close()


def test_arguments():
    for bad in ("yes", 1, 0.5):
        with pytest.raises(ValueError, match="Invalid weight_shadows"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], weight_shadows=bad)
    for kw in (dict(speculate=False), dict(bounded_staging=True)):
        with pytest.raises(ValueError, match="weight_shadows=True keeps shadows"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], weight_shadows=True, **kw)


def test_cpu_parameters_get_no_shadows_without_the_seam():
    ref, ropt, ours, opt = make(weight_shadows=True)
    for x in batches(3):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False)
        same(ref, ours)
    assert opt.stats()["spec_shadowed"] == 0
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")
@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_cuda_default_shadows_and_frees_them(recipe):
    """On a GPU with room, weight_shadows=None shadows every speculated update of a plain clipping loop and frees
    them at step(): the memory allocated after each step is what it was after the first (no leak); torch's bits."""
    ref, ropt, ours, opt = make(recipe, device="cuda")
    after = []
    for x in batches(4, device="cuda"):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False, clip_to(2.0))
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        same(ref, ours)
    st = opt.stats()
    assert st["spec_shadowed"] == st["spec_updates"] > 0
    assert st["spec_shadow_peak_bytes"] == _bytes(ours)
    assert after[1:] == after[:1] * 3
    opt.close()
