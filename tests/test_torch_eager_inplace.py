"""Inside ``last_micro_batch()``, host updates in place (no kept copies) once a step has shown the loop leaving that
backward's gradients alone (``speculate=None``), from the first with ``speculate=False``, never with ``True``: bit
for bit torch.optim.AdamW's in every case, the copies freed, and a change the in-place updates cannot follow refused
(``step()``, ``clip_grad_norm_``, GradScaler, ``zero_grad()``, a second backward), the next step speculating again.
CPU; fast. GPU: the gpu-marked variant."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from test_torch_speculate import CPU, CUDA, batches, loss_fn, make, same, same_state  # noqa: E402


def hinted_step(ref, ropt, ours, opt, x, between=None):
    """One step of both: ours' backward inside ``last_micro_batch()``; ``between(model, optimizer)`` after each
    backward."""
    for m, o in ((ref, ropt), (ours, opt)):
        loss = loss_fn(m, x)
        if o is opt:
            with opt.last_micro_batch():
                loss.backward()
        else:
            loss.backward()
        if between is not None:
            between(m, o)
        o.step()
        o.zero_grad()


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("recipe", ["fp32", "fused", "amsgrad", "bf16"])
@pytest.mark.parametrize("spec", [None, False, True])
def test_in_place_after_a_clean_step(recipe, spec, device):
    """Five hinted steps, gradients untouched: torch's bits; speculate=None speculates the first step only (its
    copies freed after it), False none, True every one."""
    ref, ropt, ours, opt = make(recipe, device=device, speculate=spec)
    n = len(list(ours.parameters()))
    for i, x in enumerate(batches(5, device=device)):
        hinted_step(ref, ropt, ours, opt, x)
        same(ref, ours)
        st = opt.stats()
        want = {None: 1, False: 0, True: i + 1}[spec]
        assert st["spec_steps_committed"] == want and st["spec_updates"] == want * n, (i, st)
        assert (st["spec_backup_bytes"] > 0) == bool(spec), st
    same_state(ropt, opt, ref, ours)
    opt.close()


def _clip(m, o):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)


@pytest.mark.parametrize("spec", [None, False])
def test_a_change_after_in_place_updates_is_refused_and_the_next_step_speculates(spec):
    """In place (after a clean step, or speculate=False), the loop's clip_grad_norm_ is refused at step() naming
    speculate=True; after a reload the next hinted step speculates (None: clipped steps commit or redo exactly)."""
    ref, ropt, ours, opt = make(speculate=spec)
    xs = batches(5)
    hinted_step(ref, ropt, ours, opt, xs[0])
    if spec is None:
        hinted_step(ref, ropt, ours, opt, xs[1])  # the first in-place step
        same(ref, ours)
    before = copy.deepcopy(opt.state_dict())  # a checkpoint: the step before the refused one
    ref_before = {k: v.clone() for k, v in ours.state_dict().items()}
    with opt.last_micro_batch():
        loss_fn(ours, xs[2]).backward()
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="speculate=True"):
        opt.step()
    opt.zero_grad()
    ours.load_state_dict(ref_before)
    opt.load_state_dict(before)
    same(ref, ours)
    redone = opt.stats()["spec_steps_redone"]
    for x in xs[2:4]:  # clipped steps from the checkpoint: speculated and redone (False: refused every time)
        if spec is False:
            with opt.last_micro_batch():
                loss_fn(ours, x).backward()
            _clip(ours, opt)
            with pytest.raises(RuntimeError, match="speculate=True"):
                opt.step()
            break
        hinted_step(ref, ropt, ours, opt, x, _clip)
        same(ref, ours)
    else:
        assert opt.stats()["spec_steps_redone"] - redone == 2
        same_state(ropt, opt, ref, ours)
    opt.close()


@pytest.mark.parametrize("what", ["clip_method", "zero_grad", "second_backward", "grad_scaler"])
def test_in_place_refusals(what):
    """With in-place updates pending: opt.clip_grad_norm(), zero_grad() before step(), a second backward inside the
    block and GradScaler's step raise, naming the cause; then zero_grad() and a reload work, and the loop goes on
    with torch's bits."""
    ref, ropt, ours, opt = make(speculate=False)
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(ours.state_dict())
    x = batches(1)[0]
    scaler = torch.amp.GradScaler("cpu")
    with opt.last_micro_batch():
        loss = loss_fn(ours, x)
        (scaler.scale(loss) if what == "grad_scaler" else loss).backward()
        if what == "second_backward":
            with pytest.raises(RuntimeError, match="second backward"):
                loss_fn(ours, x).backward()
    if what == "clip_method":
        with pytest.raises(RuntimeError, match="clip_grad_norm"):
            opt.clip_grad_norm(1.0)
    elif what == "zero_grad":
        with pytest.raises(RuntimeError, match="zero_grad"):
            opt.zero_grad()
    elif what == "grad_scaler":
        with pytest.raises(RuntimeError, match="GradScaler"):
            scaler.step(opt)
    if what == "second_backward":
        with pytest.raises(RuntimeError, match="zero_grad"):  # the first backward's updates are still pending
            opt.zero_grad()
    with pytest.raises(RuntimeError, match="not speculative"):  # sticky until a reload: never taken twice
        opt.step()
    with pytest.raises(RuntimeError, match="not speculative"):
        opt.state_dict()
    opt.zero_grad()
    ours.load_state_dict(weights)
    opt.load_state_dict(saved)
    for x in batches(2, seed=5):
        hinted_step(ref, ropt, ours, opt, x)
        same(ref, ours)
    opt.close()


def test_no_room_for_copies_updates_in_place_where_hinted(monkeypatch):
    """speculate=None where the kept copies do not fit: a warning naming the choice, and hinted backwards update in
    place (not at step()), torch's bits."""
    from trainstream.core import _budget

    monkeypatch.setattr(_budget, "speculation_fits", lambda nbytes, margin=None: False)
    ref, ropt, ours, opt = make()
    with pytest.warns(RuntimeWarning, match="inside last_micro_batch"):
        for x in batches(3):
            hinted_step(ref, ropt, ours, opt, x)
            same(ref, ours)
    st = opt.stats()
    assert st["spec_updates"] == 0 and st["spec_backup_bytes"] == 0
    assert st["eager_updates"] >= 2 * len(list(ours.parameters())), st
    same_state(ropt, opt, ref, ours)
    opt.close()


@pytest.mark.parametrize("spec", [None, False, True])
def test_state_read_between_an_in_place_backward_and_step(spec):
    """torch shows the pre-step state between backward and step(); an update that ran in place from a hook has none
    left: the read raises (naming speculate=True) and changes nothing, and the step goes on to torch's bits. With
    speculate=True the read sees torch's pre-step state."""
    ref, ropt, ours, opt = make(speculate=spec)
    p, q = next(ref.parameters()), next(ours.parameters())
    for i, x in enumerate(batches(4)):
        def between(m, o):
            if i < 2:
                return
            if o is ropt:
                between.want = ropt.state[p]["exp_avg"].clone()
            elif spec is True:
                assert torch.equal(opt.state[q]["exp_avg"], between.want)
            else:
                with pytest.raises(RuntimeError, match="speculate=True"):
                    opt.state[q]
                with pytest.raises(RuntimeError, match=r"between a last_micro_batch\(\) backward and step"):
                    opt.state_dict()
        hinted_step(ref, ropt, ours, opt, x, between)
        same(ref, ours)
    same_state(ropt, opt, ref, ours)  # after step(): read as usual
    opt.close()
