"""Speculation's bitwise check against device copies of the gradients (``grad_copies``, issue 42): the hook keeps a
copy of each speculated gradient where it is produced and ``step()`` compares ``param.grad`` with it there instead of
sending the staged host copy back over PCIe. On the CPU the path is forced through its private seam
(``_gradcopy.COPY_DEVICES``: CPU gradients get copies too), so every loop of test_torch_speculate.py's kind runs it
here, beside torch.optim.AdamW, bit for bit: clipping on every step, on none, alternating; GradScaler skips and inf
gradients; a gradient edited in place between backward and ``step()``; accumulation 1 and 4 with and without the
hint; the copies released at ``step()``, ``zero_grad()`` and ``load_state_dict()``; the memory decision and the
user's choice. The ``gpu`` tests run the real CUDA path (no seam)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from test_torch_speculate import (_edit, batches, clip_to, gradient_state, loss_fn, make, run_step, same,  # noqa: E402,F401
                                  same_state, scaler_loop)

from trainstream.torch import OffloadAdamW  # noqa: E402
from trainstream.torch import _gradcopy  # noqa: E402

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")])


@pytest.fixture
def copies_on(monkeypatch):
    """CPU gradients get device copies too (the seam); returns the weak references to every copy kept."""
    monkeypatch.setattr(_gradcopy, "COPY_DEVICES", frozenset({"cpu", "cuda"}))
    refs = []
    keep = _gradcopy.GradCopies.keep

    def tracked(self, sid, grad, need):
        copy = keep(self, sid, grad, need)
        if copy is not None:
            refs.append(weakref.ref(copy))
        return copy
    monkeypatch.setattr(_gradcopy.GradCopies, "keep", tracked)
    return refs


def _released(opt, refs):
    assert len(opt._grads.copies) == 0 and opt._grads.copies.held == 0
    if any(r() is not None for r in refs):
        gc.collect()  # (slow: only where a reference cycle may hold one)
        assert all(r() is None for r in refs), "a gradient copy outlived step()"


def _grad_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


CLIP_CASES = [("fp32", p) for p in ("every", "none", "alternating")] + [(r, "alternating") for r in ("fused", "bf16")]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("recipe,pattern", CLIP_CASES, ids=[f"{r}-{p}" for r, p in CLIP_CASES])
@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_clipping_checked_against_device_copies(copies_on, recipe, pattern, hint, device):
    """The loop's own clip_grad_norm_ (factor below 1.0 on every step, on none, alternating): the first step compares
    with the staged copies (no copy kept yet), every later one with the device copies; torch's bits; the copies gone
    after each step."""
    ref, ropt, ours, opt = make(recipe, device=device, grad_copies=None if device == "cpu" else True)
    clipped = {"every": [True] * 4, "none": [False] * 4, "alternating": [i % 2 == 0 for i in range(4)]}[pattern]
    n = len(list(ours.parameters()))
    for i, (x, clip) in enumerate(zip(batches(4, device=device), clipped)):
        between = clip_to(0.5 if clip else 2.0)
        norms = [run_step(m, o, [x], hint and o is opt, between) for m, o in ((ref, ropt), (ours, opt))]
        assert norms[0] == norms[1]
        same(ref, ours)
        _released(opt, copies_on)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert (st["spec_checks_staged"], st["spec_checks_device"]) == (n, 3 * n)
    assert st["spec_copy_peak_bytes"] == _grad_bytes(ours)
    assert st["spec_steps_redone"] == sum(clipped)
    opt.close()


def test_a_loop_that_changes_no_gradient_keeps_no_copy(copies_on):
    """No clipping, no edit: the version check commits every step; no copy is ever kept."""
    ref, ropt, ours, opt = make()
    for x in batches(4):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False)
        same(ref, ours)
    st = opt.stats()
    assert (st["spec_checks_device"], st["spec_checks_staged"], st["spec_copy_peak_bytes"]) == (0, 0, 0)
    assert st["spec_steps_committed"] == 4 and not copies_on
    opt.close()


SCALER_CASES = [("fp32", "plain")] + [(r, "unscale_clip") for r in ("fp32", "fused", "bf16")]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("recipe,flow", SCALER_CASES, ids=[f"{r}-{f}" for r, f in SCALER_CASES])
def test_grad_scaler_skips_and_inf_gradients(copies_on, recipe, flow, device):
    """GradScaler: an inf loss on step 2 and a NaN gradient on step 5 skip those steps as torch skips them; after
    unscale_ (no version moved) every gradient is compared, from step 2 on with its device copy."""
    if device == "cuda" and recipe == "bf16":
        pytest.skip("torch's CUDA GradScaler does not unscale bf16 gradients")
    ref, ropt, ours, opt = make(recipe, device=device, grad_copies=None if device == "cpu" else True)
    scaler_loop(ref, ropt, ours, opt, device, flow, lambda: _released(opt, copies_on))
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert (st["spec_steps_committed"], st["spec_steps_redone"]) == (3, 5)
    assert (st["spec_checks_device"] > 0) == (flow == "unscale_clip")
    opt.close()


KINDS = ["mul", "add", "mul_one", "replace", "drop", "zero_grad", "zero_grad_in_place", "lr", "weight", "state_dict"]


@pytest.mark.parametrize("kind", KINDS)
def test_changes_between_backward_and_step(copies_on, kind):
    """A gradient edited in place (after the loop's clip_grad_norm_, so that copies are kept from step 2 on),
    replaced or dropped, all gradients zeroed, the learning rate or a weight changed, the state read: torch's bits."""
    ref, ropt, ours, opt = make()
    for i, x in enumerate(batches(3)):
        def between(m, o):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
            if i:
                _edit(kind)(m, o)
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False, between)
        same(ref, ours)
        _released(opt, copies_on)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert st["spec_copy_peak_bytes"] == _grad_bytes(ours)  # kept at step 2's hooks (step 1 compared)
    if kind == "mul_one":
        assert st["spec_steps_committed"] == 3 and st["spec_checks_device"] == 2 * len(list(ours.parameters()))
    else:
        assert st["spec_steps_committed"] == 1


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("hint", [False, True], ids=["plain", "hint"])
def test_accumulation(copies_on, micro, hint, device):
    """Accumulation 1 and 4, with and without the hint, the loop clipping (factor 1.0): only the speculated
    backward's gradients are copied (the copies' peak is the gradients' bytes once), torch's bits."""
    ref, ropt, ours, opt = make(device=device, grad_copies=None if device == "cpu" else True)
    xs = batches(4 * micro, device=device)
    for i in range(4):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, xs[i * micro:(i + 1) * micro], hint and o is opt, clip_to(2.0))
        same(ref, ours)
        _released(opt, copies_on)
    same_state(ropt, opt, ref, ours)
    st = opt.stats()
    assert st["spec_copy_peak_bytes"] == _grad_bytes(ours)
    assert st["spec_checks_device"] >= 2 * len(list(ours.parameters()))
    opt.close()


@pytest.mark.parametrize("how", ["zero_grad", "load_state_dict"])
def test_copies_released_between_backward_and_step(copies_on, how):
    """zero_grad() or load_state_dict() between backward and step() release the copies at once; the loop goes on
    with torch's bits."""
    ref, ropt, ours, opt = make()
    saved = {}
    for i, x in enumerate(batches(4)):
        for m, o in ((ref, ropt), (ours, opt)):
            def between(m, o):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
                if i != 2:
                    return
                if isinstance(o, OffloadAdamW):
                    assert len(o._grads.copies) == len(list(m.parameters()))
                if how == "zero_grad":
                    o.zero_grad()
                else:
                    o.load_state_dict(saved[o])
                if isinstance(o, OffloadAdamW):
                    _released(o, copies_on)
            run_step(m, o, [x], False, between)
            if i == 0:
                saved[o] = copy.deepcopy(o.state_dict())  # torch's holds its live tensors
        same(ref, ours)
    same_state(ropt, opt, ref, ours)
    opt.close()


def test_copies_released_when_a_forward_rolls_back(copies_on, gradient_state):
    """Under Accelerate's signal (accumulation 4) a forward between the last backward and step() rolls the uploaded
    updates back: their copies go with them; torch's bits."""
    ref, ropt, ours, opt = make()
    xs = batches(12)
    for i in range(3):
        for m, o in ((ref, ropt), (ours, opt)):
            for j, x in enumerate(xs[4 * i:4 * i + 4]):
                gradient_state._set_sync_gradients(j == 3)
                (loss_fn(m, x) / 4).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
            if i == 2:
                if o is opt:
                    assert len(opt._grads.copies) == len(list(m.parameters()))
                with torch.no_grad():
                    m(xs[0])
                if o is opt:
                    _released(opt, copies_on)
            o.step()
            o.zero_grad()
        same(ref, ours)
    assert opt.stats()["spec_checks_device"] == len(list(ours.parameters()))  # step 2's
    opt.close()


def test_the_memory_decides_where_the_user_does_not(copies_on, monkeypatch):
    """grad_copies=None: copies where the device's free memory less a tenth of its total holds them (and the
    gradients not allocated yet), else the staged copies with one warning; True keeps them anyway, False never."""
    calls = []

    def memory(device):
        calls.append(device)
        return (1000, 10_000)  # 1,000 bytes free of 10,000: less than the headroom
    monkeypatch.setattr(_gradcopy, "device_memory", memory)
    for choice in (None, True, False):
        ref, ropt, ours, opt = make(grad_copies=choice)
        ctx = pytest.warns(RuntimeWarning, match="grad_copies=True keeps the copies") if choice is None else _quiet()
        with ctx:
            for x in batches(3):
                for m, o in ((ref, ropt), (ours, opt)):
                    run_step(m, o, [x], False, clip_to(2.0))
                same(ref, ours)
        st = opt.stats()
        n = len(list(ours.parameters()))
        want_device = 2 * n if choice else 0
        assert (st["spec_checks_device"], st["spec_checks_staged"]) == (want_device, 3 * n - want_device)
        opt.close()
    assert len(calls) == 1  # asked once, by the default, at its first copy
    monkeypatch.setattr(_gradcopy, "device_memory", lambda device: (10 ** 9, 10 ** 9))
    ref, ropt, ours, opt = make()
    for x in batches(2):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False, clip_to(2.0))
    assert opt.stats()["spec_checks_device"] == len(list(ours.parameters()))
    opt.close()


def test_an_out_of_memory_copy_falls_back(copies_on, monkeypatch):
    """A copy the allocator cannot give: copies released, a warning, the check over the staged copies; torch's
    bits."""
    ref, ropt, ours, opt = make()
    real = torch.Tensor.clone
    for i, x in enumerate(batches(3)):
        run_step(ref, ropt, [x], False, clip_to(2.0))
        if i == 1:
            calls = []

            def clone(t, *a, **k):
                calls.append(1)
                if len(calls) == 2:
                    raise torch.cuda.OutOfMemoryError("injected")
                return real(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, "clone", clone)
            with pytest.warns(RuntimeWarning, match="out of GPU memory"):
                loss_fn(ours, x).backward()
            monkeypatch.setattr(torch.Tensor, "clone", real)
            clip_to(2.0)(ours, opt)
            opt.step()
            opt.zero_grad()
        else:
            run_step(ours, opt, [x], False, clip_to(2.0))
        same(ref, ours)
        _released(opt, copies_on)
    st = opt.stats()
    assert st["spec_checks_device"] == 0 and st["spec_steps_committed"] == 3
    opt.close()


def test_arguments():
    for bad in ("yes", 1, 0.5):
        with pytest.raises(ValueError, match="Invalid grad_copies"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], grad_copies=bad)
    for kw in (dict(speculate=False), dict(bounded_staging=True)):
        with pytest.raises(ValueError, match="grad_copies=True keeps copies"):
            OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], grad_copies=True, **kw)
    opt = OffloadAdamW([torch.nn.Parameter(torch.zeros(2))], grad_copies=False, threads=1)
    assert opt.stats()["spec_copy_peak_bytes"] == 0
    opt.close()


def test_cpu_gradients_get_no_copies_without_the_seam():
    """The CPU's check reads the staging in host memory (no transfer): no copies there."""
    ref, ropt, ours, opt = make(grad_copies=True)
    for x in batches(3):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False, clip_to(2.0))
        same(ref, ours)
    st = opt.stats()
    assert st["spec_checks_device"] == 0 and st["spec_checks_staged"] == 3 * len(list(ours.parameters()))
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")
def test_cuda_default_keeps_copies_and_frees_them():
    """On a GPU with room, grad_copies=None keeps copies from the second clipping step on and frees them at step():
    the memory allocated after each step is what it was after the first (no leak)."""
    ref, ropt, ours, opt = make(device="cuda")
    after = []
    for x in batches(4, device="cuda"):
        for m, o in ((ref, ropt), (ours, opt)):
            run_step(m, o, [x], False, clip_to(2.0))
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
        same(ref, ours)
    st = opt.stats()
    assert st["spec_checks_device"] == 3 * len(list(ours.parameters()))
    assert st["spec_copy_peak_bytes"] == _grad_bytes(ours)
    assert after[1:] == after[:1] * 3
    opt.close()


def _quiet():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            yield
    return ctx()
