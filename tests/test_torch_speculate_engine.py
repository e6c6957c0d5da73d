"""The engine's speculative updates (``trainstream/core/_speculate.py``) on the CPU through the torch backend: a
rollback restores weights, state, step count and uploaded weights bit for bit and leaves the gradient staged; a
commit keeps what a plain update gives; a failed speculative update is never "restored" from partial copies; the
refusals. Slots of several chunks and odd sizes (the copies are taken block by block)."""

from __future__ import annotations

import numpy as np
import pytest

from trainstream import contract as C
from trainstream.core import _engine as E

torch = pytest.importorskip("torch")
from trainstream.backends.torch import TorchBackend  # noqa: E402

N = 3 * 4096 + 77  # several chunks of 4096, a partial one


def _engine():
    return E.Engine(TorchBackend(torch.device("cpu")), mode="cpu", threads=2, chunk_size=4096)


def _slot(eng, dtype=torch.float32, amsgrad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(N, generator=g).to(dtype)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    recipe = C.TorchRecipe(C.resolve_impl("cpu"), "cpu", name, amsgrad=amsgrad)
    return p, eng.add_param(p, N, name, "cpu", recipe=recipe)


def _grad(dtype, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return (torch.randn(N, generator=g) * 1e-2).to(dtype)


HP = C.AdamWHyperParams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _snapshot(eng, sid, p):
    st = eng.state(sid)
    return {k: (np.asarray(v).copy() if not isinstance(v, int) else v) for k, v in st.items()}, p.clone()


def _same(a, b):
    (sa, pa), (sb, pb) = a, b
    assert sa.keys() == sb.keys()
    for k in sa:
        if k == "step":
            assert sa[k] == sb[k]
        else:
            assert np.array_equal(sa[k].view(np.uint8), sb[k].view(np.uint8)), k
    assert torch.equal(pa.view(torch.int16 if pa.element_size() == 2 else torch.int32),
                       pb.view(torch.int16 if pb.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("dtype,amsgrad", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("upload", [False, True], ids=["upload-at-commit", "upload-at-once"])
def test_rollback_restores_every_bit_and_commit_keeps_the_update(dtype, amsgrad, upload):
    eng = _engine()
    p, sid = _slot(eng, dtype, amsgrad)
    plain_eng = _engine()
    q, qsid = _slot(plain_eng, dtype, amsgrad)
    for step in range(3):  # a few plain steps first: non-zero state
        g = _grad(dtype, step)
        for e, s in ((eng, sid), (plain_eng, qsid)):
            e.offload_grad(s, g, str(g.dtype).split(".")[1], HP)
        eng.synchronize()
        plain_eng.synchronize()
    before = _snapshot(eng, sid, p)
    g = _grad(dtype, 9)
    name = str(g.dtype).split(".")[1]
    eng.offload_grad(sid, g, name, HP, speculate=True, upload=upload)
    assert eng.speculative(sid)
    assert np.array_equal(eng.staged_grad(sid).view(np.uint8), g.view(torch.uint8).numpy())
    if not upload:
        assert torch.equal(p, before[1])  # nothing uploaded before the commit
    eng.rollback([sid])
    eng.synchronize()
    assert not eng.speculative(sid)
    _same(_snapshot(eng, sid, p), before)
    # the gradient stays staged: a step updates from it, as the plain engine's own update of it
    eng.step([(sid, HP)])
    plain_eng.offload_grad(qsid, g, name, HP)
    eng.synchronize()
    plain_eng.synchronize()
    _same(_snapshot(eng, sid, p), _snapshot(plain_eng, qsid, q))
    # speculate again and commit: what the plain engine computes
    g = _grad(dtype, 10)
    eng.offload_grad(sid, g, name, HP, speculate=True, upload=upload)
    eng.commit([sid])
    eng.count_spec_step(False)
    plain_eng.offload_grad(qsid, g, name, HP)
    eng.synchronize()
    plain_eng.synchronize()
    _same(_snapshot(eng, sid, p), _snapshot(plain_eng, qsid, q))
    st = eng.stats()
    assert (st["spec_updates"], st["spec_committed"], st["spec_rolled_back"]) == (2, 1, 1)
    assert st["spec_steps_committed"] == 1 and st["redo_ms_total"] > 0
    assert st["spec_backup_bytes"] == N * (4 if dtype == torch.float32 else 2) * (4 if amsgrad else 3)
    eng.close()
    plain_eng.close()


def test_reads_and_replacements_roll_back_first():
    """state() (what a framework shows), load_state, discard_grads: never the speculative update's."""
    eng = _engine()
    p, sid = _slot(eng)
    before = _snapshot(eng, sid, p)
    eng.offload_grad(sid, _grad(torch.float32, 1), "float32", HP, speculate=True, upload=True)
    assert eng.get_step(sid) == 0
    _same(_snapshot(eng, sid, p), before)  # state(): rolled back (and the weights uploaded again)
    assert not eng.speculative(sid)
    eng.offload_grad(sid, _grad(torch.float32, 1), "float32", HP, speculate=True, upload=False)
    eng.discard_grads()
    eng.synchronize()
    _same(_snapshot(eng, sid, p), before)
    eng.close()


def test_a_failed_speculative_update_is_not_restored(monkeypatch):
    """Its copies are partial: the rollback restores nothing and uploads nothing; the error stays sticky."""
    from trainstream import _host_kernels as K

    eng = _engine()
    p, sid = _slot(eng)
    w = p.clone()

    def boom(*args, **kwargs):
        raise FloatingPointError("injected")
    monkeypatch.setattr(K, "adamw_chunk", boom)
    eng.offload_grad(sid, _grad(torch.float32, 1), "float32", HP, speculate=True, upload=True)
    eng.drain()
    eng.rollback([sid])
    eng.drain()
    assert torch.equal(p, w)
    with pytest.raises(E.WorkerError, match="injected"):
        eng.check_error()
    eng.close()


def test_refusals():
    eng = _engine()
    _, sid = _slot(eng)
    g = _grad(torch.float32, 1)
    with pytest.raises(ValueError, match="cannot take a speculative update"):
        eng.offload_grad(sid, g, "float32", None, speculate=True)
    with pytest.raises(ValueError, match="speculative update's assumptions"):
        eng.offload_grad(sid, g, "float32", HP, coef=0.5)
    with pytest.raises(ValueError, match="holds no speculative update"):
        eng.commit([sid])
    eng.rollback([sid])  # none: nothing to do
    eng.close()


def test_commit_uploads_each_weight_once_whether_its_update_ran_or_still_runs(monkeypatch):
    """commit() of a finished update uploads its weights at once (together with the others finished); of one still
    running, from its last chunk: once each, the plain engine's bits, nothing uploaded before the commit."""
    import threading

    from trainstream import _host_kernels as K

    eng, plain = _engine(), _engine()
    slots = [_slot(eng, seed=i) for i in range(3)]
    refs = [_slot(plain, seed=i) for i in range(3)]
    uploads = []
    backend = eng.host.backend
    many, one = backend.copy_many_to_device, backend.copy_to_device
    monkeypatch.setattr(backend, "copy_many_to_device", lambda pairs, after: (
        uploads.extend(id(d) for d, _ in pairs), many(pairs, after))[1])
    monkeypatch.setattr(backend, "copy_to_device", lambda d, s, after: (uploads.append(id(d)), one(d, s, after))[1])
    gate, real = threading.Event(), K.adamw_chunk
    blocked = eng.host._slot(slots[0][1]).exp_avg.array

    def chunk(*args, **kwargs):
        if args[2] is blocked and args[9] == N:  # its last chunk (one worker held, the other goes on)
            assert gate.wait(30)
        return real(*args, **kwargs)
    monkeypatch.setattr(K, "adamw_chunk", chunk)
    before = [p.clone() for p, _ in slots]
    for (p, sid), (q, qsid) in zip(slots, refs):
        g = _grad(torch.float32, sid)
        eng.offload_grad(sid, g, "float32", HP, speculate=True, upload=False)
        plain.offload_grad(qsid, g, "float32", HP)
    for _, sid in slots[1:]:
        eng.host._wait_idle(eng.host._slot(sid))
    assert not uploads and all(torch.equal(p, b) for (p, _), b in zip(slots, before))
    eng.commit([sid for _, sid in slots])
    assert sorted(uploads) == sorted(id(p) for p, _ in slots[1:])  # the finished ones, now
    assert torch.equal(slots[0][0], before[0])  # the running one: not yet
    gate.set()
    eng.synchronize()
    plain.synchronize()
    assert sorted(uploads) == sorted(id(p) for p, _ in slots)  # once each
    for (p, sid), (q, qsid) in zip(slots, refs):
        _same(_snapshot(eng, sid, p), _snapshot(plain, qsid, q))
    eng.close()
    plain.close()


# -- copies taken ahead (prefetch_backups) --------------------------------------------------------------------------

def _ahead(eng, sid, timeout=30.0):
    """Wait until slot ``sid``'s copies taken ahead are all done; returns their record."""
    import time

    from trainstream.core._hostslot import COPIED

    pre, t = eng.host._slot(sid).pre, time.monotonic()
    assert pre is not None
    while not pre.queued or any(c != COPIED for c in pre.chunks):  # queued once the slot's work has run
        assert time.monotonic() - t < timeout
        time.sleep(0.001)
    return pre


def _speculated_once(dtype=torch.float32, amsgrad=False):
    """An engine whose slot speculated and committed once (its copies allocated), and a plain twin."""
    eng, plain = _engine(), _engine()
    (p, sid), (q, qsid) = _slot(eng, dtype, amsgrad), _slot(plain, dtype, amsgrad)
    name = str(p.dtype).split(".")[1]
    for step in range(2):
        g = _grad(dtype, step)
        eng.offload_grad(sid, g, name, HP, speculate=step == 1, upload=False)
        plain.offload_grad(qsid, g, name, HP)
    eng.commit([sid])
    eng.synchronize()
    plain.synchronize()
    return eng, plain, p, sid, q, qsid, name


def _rolled_back_exactly(eng, sid, p, g, name, upload=False):
    """A speculative update from ``g``, rolled back: weights and state as before it, every bit."""
    before = _snapshot(eng, sid, p)
    eng.offload_grad(sid, g, name, HP, speculate=True, upload=upload)
    eng.rollback([sid])
    eng.synchronize()
    _same(_snapshot(eng, sid, p), before)


def _as_plain(eng, sid, p, plain, qsid, q):
    """Both engines' queued work done: the same weights and state, every bit."""
    eng.synchronize()
    plain.synchronize()
    _same(_snapshot(eng, sid, p), _snapshot(plain, qsid, q))


@pytest.mark.parametrize("dtype,amsgrad", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_copies_taken_ahead_restore_every_bit_and_commit_as_before(dtype, amsgrad):
    """Copied ahead, a chunk is not copied by the update; a rollback restores every bit from them, a chunk the copies
    ahead did not reach (here: its copy scribbled over and marked so) is copied by the update itself."""
    from trainstream.core._hostslot import FREE

    eng, plain, p, sid, q, qsid, name = _speculated_once(dtype, amsgrad)
    eng.prefetch_backups([sid])
    pre = _ahead(eng, sid)
    s = eng.host._slot(sid)
    pre.chunks[1] = FREE  # as if the update came first there
    for copy in s.backup.values():
        copy[4096:8192] = copy[:4096][::-1]  # garbage, unless the update copies it again
    backup_ms = eng.stats()["backup_ms_total"]
    g = _grad(dtype, 5)
    _rolled_back_exactly(eng, sid, p, g, name)
    st = eng.stats()
    assert st["precopy_ms_total"] > 0 and st["backup_ms_total"] > backup_ms  # chunk 1 only (not timed per chunk)
    eng.step([(sid, HP)])  # the redo from the staged gradient, then ahead again and a commit
    plain.offload_grad(qsid, g, name, HP)
    eng.prefetch_backups([sid])
    _ahead(eng, sid)
    g = _grad(dtype, 6)
    eng.offload_grad(sid, g, name, HP, speculate=True, upload=False)
    eng.commit([sid])
    plain.offload_grad(qsid, g, name, HP)
    _as_plain(eng, sid, p, plain, qsid, q)
    eng.close()
    plain.close()


@pytest.mark.parametrize("write", ["views", "load_state", "plain_update"])
def test_writes_discard_the_copies_taken_ahead(write):
    """The state handed out as views and changed, a load, an update that is not speculative: the copies taken
    before are discarded, so a rollback after them restores the state as it was written."""
    eng, plain, p, sid, q, qsid, name = _speculated_once()
    eng.prefetch_backups([sid])
    _ahead(eng, sid)
    if write == "views":
        eng.state(sid, copy=False)["exp_avg"][:] *= 0.5
    elif write == "load_state":
        st = eng.state(sid)
        st["exp_avg_sq"] = np.asarray(st["exp_avg_sq"]) * 2
        eng.load_state(sid, st)
    else:
        eng.offload_grad(sid, _grad(torch.float32, 7), name, HP)
    assert eng.host._slot(sid).pre is None
    eng.synchronize()
    _rolled_back_exactly(eng, sid, p, _grad(torch.float32, 8), name, upload=True)
    eng.close()
    plain.close()


def test_copies_ahead_wait_for_the_slots_queued_work(monkeypatch):
    """Asked for while the slot's update still runs, the copies are queued once it has run: they hold what it wrote,
    so a rollback of the next speculative update restores the state after it."""
    import threading

    from trainstream import _host_kernels as K

    eng, plain, p, sid, q, qsid, name = _speculated_once()
    gate, real = threading.Event(), K.adamw_chunk
    monkeypatch.setattr(K, "adamw_chunk", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
    g = _grad(torch.float32, 3)
    eng.offload_grad(sid, g, name, HP)  # held in its kernel
    plain.offload_grad(qsid, g, name, HP)
    eng.prefetch_backups([sid])
    assert not eng.host._slot(sid).pre.queued
    gate.set()
    _ahead(eng, sid)
    eng.synchronize()
    g = _grad(torch.float32, 5)
    _rolled_back_exactly(eng, sid, p, g, name)
    eng.step([(sid, HP)])
    plain.offload_grad(qsid, g, name, HP)
    _as_plain(eng, sid, p, plain, qsid, q)
    eng.close()
    plain.close()
