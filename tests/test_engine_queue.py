"""The workers' queue order (trainstream._engine._WorkQueue): forward order across slots,
submission order within a slot, jobs whose copy has not landed passed over."""

from trainstream import _engine as E


def _drain(q):
    out = []
    while True:
        job = q.get()
        if job is None:
            return out
        out.append(job())


def test_lowest_slot_first_submission_order_within_a_slot():
    q = E._WorkQueue()
    q._fifo = False
    for slot, tag in [(5, "5a"), (3, "3a"), (5, "5b"), (1, "1a"), (3, "3b")]:
        q.put(lambda tag=tag: tag, slot)
    q.put(None, float("inf"))
    assert _drain(q) == ["1a", "3a", "3b", "5a", "5b"]


def test_not_landed_job_passed_over_but_never_within_its_slot():
    q = E._WorkQueue()
    q._fifo = False
    landed = {"x": False}
    q.put(lambda: "1-first", 1, lambda: landed["x"])
    q.put(lambda: "1-second", 1, None)  # same slot: must wait for 1-first
    q.put(lambda: "2", 2, None)
    assert q.get()() == "2"  # slot 1's oldest job cannot run yet; slot 2's can
    # nothing else can run now: the oldest job runs (its body would wait for the copy)
    assert q.get()() == "1-first"
    assert q.get()() == "1-second"


def test_fifo_order_when_asked():
    q = E._WorkQueue()
    q._fifo = True
    for slot, tag in [(5, "5a"), (3, "3a"), (1, "1a")]:
        q.put(lambda tag=tag: tag, slot, lambda: False)
    q.put(None, float("inf"))
    assert _drain(q) == ["5a", "3a", "1a"]
