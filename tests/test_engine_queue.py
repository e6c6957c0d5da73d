"""The workers' queue order (trainstream.core._pool._WorkQueue): forward order across slots,
submission order within a slot, jobs whose copy has not landed passed over."""

import types

import numpy as np
import pytest

from trainstream.core import _host as E
from trainstream.core import _pool


class _HostBackend:
    """Just enough of a backend for engine bookkeeping tests: host buffers, no copies."""

    def host_empty(self, numel, dtype, *, pinned, what):
        array = np.zeros(numel, np.float32 if dtype == "float32" else np.uint16)
        return types.SimpleNamespace(array=array, pinned=False, handle=None)

    def param_to_host_f32(self, param, out):
        out[:] = 0


def _put(q, job, priority=0.0, ready=None):
    """One job (the library queues a batch's jobs with ``put_many``)."""
    q.put_many([job], priority, ready)


def _drain(q):
    out = []
    while True:
        job = q.get()
        if job is None:
            return out
        out.append(job())


def test_lowest_slot_first_submission_order_within_a_slot():
    q = _pool._WorkQueue()
    for slot, tag in [(5, "5a"), (3, "3a"), (5, "5b"), (1, "1a"), (3, "3b")]:
        _put(q, lambda tag=tag: tag, slot)
    q.close(1)  # one worker's stop marker
    assert _drain(q) == ["1a", "3a", "3b", "5a", "5b"]


def test_not_landed_job_passed_over_but_never_within_its_slot():
    q = _pool._WorkQueue()
    landed = {"x": False}
    _put(q, lambda: "1-first", 1, lambda: landed["x"])
    _put(q, lambda: "1-second", 1, None)  # same slot: must wait for 1-first
    _put(q, lambda: "2", 2, None)
    assert q.get()() == "2"  # slot 1's oldest job cannot run yet; slot 2's can
    # nothing else can run now: the oldest job runs (its body would wait for the copy)
    assert q.get()() == "1-first"
    assert q.get()() == "1-second"


def test_oldest_job_taken_when_nothing_has_landed_and_stop_marker_last():
    q = _pool._WorkQueue()
    landed = {"x": False}
    for slot in (9, 7, 5):  # backward order: slot 9's copy was queued first
        _put(q, lambda slot=slot: slot, slot, lambda: landed["x"])
    q.close(1)  # the stop marker comes after every job still queued
    assert q.get()() == 9  # nothing landed: the oldest copy lands first
    landed["x"] = True
    assert q.get()() == 5  # then forward order again
    assert q.get()() == 7
    assert q.get() is None


def test_taken_entries_do_not_accumulate():
    q = _pool._WorkQueue()
    for i in range(1000):
        _put(q, lambda: None, i % 7)
        q.get()()
    assert len(q._all) == 0 and q._jobs == 0 and not q._order


def test_batches_of_one_slot_run_one_after_another_on_a_shared_pool():
    """With every worker on one queue, a slot's second batch (e.g. the update after an
    accumulation) starts only when its first batch has finished on every chunk."""
    import threading
    import time

    eng = E.HostPlacement(_HostBackend(), threads=4, chunk_size=4096)
    sid = eng.add_param(None, 8 * 4096, "float32", "cpu")
    s = eng._slots[sid]
    log, lock = [], threading.Lock()

    def body(tag):
        def run(c, b, e):
            time.sleep(0.002 if tag == "first" else 0.0)
            with lock:
                log.append(tag)
        return run

    eng._run_batch(s, body("first"))
    eng._run_batch(s, body("second"))
    eng._wait_idle(s)
    assert log == ["first"] * 8 + ["second"] * 8
    eng.close()


def test_failed_chained_submission_is_reported_and_does_not_hang(monkeypatch):
    """A chained batch that cannot be queued (here: its submission raises) is dropped with
    the error kept for the caller; waiting for the slot returns."""
    import pytest

    eng = E.HostPlacement(_HostBackend(), threads=2, chunk_size=4096)
    sid = eng.add_param(None, 2 * 4096, "float32", "cpu")
    s = eng._slots[sid]
    import threading
    gate = threading.Event()
    eng._run_batch(s, lambda c, b, e: gate.wait(5))
    eng._run_batch(s, lambda c, b, e: None)  # chained behind the first
    eng._run_batch(s, lambda c, b, e: None)  # and another
    real = eng._submit_batch
    monkeypatch.setattr(eng, "_submit_batch", lambda *a: (_ for _ in ()).throw(MemoryError("no room")))
    gate.set()
    eng._wait_idle(s)  # returns: the chain was dropped, not left counted
    assert s.inflight == 0 and not s.chain
    with pytest.raises(E.WorkerError, match="no room"):
        eng.errors.check()
    monkeypatch.setattr(eng, "_submit_batch", real)
    eng.errors.clear()
    eng.close()


def test_work_for_stopped_workers_raises_instead_of_hanging():
    """Once the pool has stopped (close, or its atexit finalizer), new work is refused: an
    external update raises (an XLA callback at interpreter exit would otherwise wait
    forever); the queue refuses jobs once closed."""
    eng = E.HostPlacement(_HostBackend(), threads=2, chunk_size=4096)
    eng._pool.stop()  # the pool's shutdown, as at interpreter exit (the engine itself not closed)
    a = np.zeros(10, np.float32)
    item = E.ExternalUpdate(a, a.copy(), a.copy(), a.copy(), "float32", None, None, np.zeros(16, np.float32))
    with pytest.raises(E.WorkerError, match="host workers have stopped"):
        eng.update_external([item, item], "cpu")
    q = _pool._WorkQueue()
    q.close(1)
    with pytest.raises(RuntimeError, match="stopped"):
        _put(q, lambda: None)
    assert q.get() is None


@pytest.mark.parametrize("nice", [None, 7])
def test_workers_run_at_the_nice_value_asked(nice):
    """``worker_nice`` (default 5) is the nice value of every worker thread (Linux)."""
    import os
    import threading

    if not hasattr(os, "setpriority"):
        pytest.skip("no per-thread nice values on this OS")
    want = E.WORKER_NICE if nice is None else nice
    if os.getpriority(os.PRIO_PROCESS, 0) > want:
        pytest.skip("this process already runs at a higher nice value")
    kw = {} if nice is None else {"worker_nice": nice}
    eng = E.HostPlacement(_HostBackend(), threads=2, chunk_size=4096, **kw)
    sid = eng.add_param(None, 4 * 4096, "float32", "cpu")
    seen, lock = set(), threading.Lock()

    def body(c, b, e):
        with lock:
            seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    eng._run_batch(eng._slots[sid], body)
    eng._wait_idle(eng._slots[sid])
    eng.close()
    assert seen == {want}


@pytest.mark.parametrize("value", ["5", 5.0, True])
def test_a_bad_worker_nice_is_refused(value):
    with pytest.raises(ValueError, match="worker_nice must be an integer"):
        E.HostPlacement(_HostBackend(), threads=1, worker_nice=value)
