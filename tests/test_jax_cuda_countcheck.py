"""The asynchronous count read-back of JAX ``mode="gpu"`` (``CountCheck``), on a fake
CUDA runtime: copies land only when the fake stream runs, so the ring logic (slots
reused only after their copy was read) is tested without a GPU."""

import numpy as np
import pytest

from trainstream.jax import _gpu as jc


class FakeStream:
    def __init__(self):
        self.queue = []  # pending (dst, value) copies and events, in order

    def run(self, n=None):
        """Execute the first n queued operations (all by default)."""
        n = len(self.queue) if n is None else n
        for op in self.queue[:n]:
            op()
        del self.queue[:n]


@pytest.fixture
def fake(monkeypatch):
    stream = FakeStream()
    memory = {}  # address -> int32 value (the device counts)

    class Pinned:
        def __init__(self, numel, dtype, device, what):
            self.array = np.zeros(numel, dtype)
            self.ptr = 1 << 40

    def memcpy(dst, src, nbytes, kind, strm, device):
        slot = (dst - (1 << 40)) // 4
        value = memory[src]
        stream.queue.append(lambda: ring.__setitem__(slot, value))

    class Event:  # recorded on the fake stream at creation, as trainstream._cuda.Event
        def __init__(self, strm, device):
            self.done = False
            stream.queue.append(lambda: setattr(self, "done", True))

        def query(self):
            return self.done

        def synchronize(self):
            while not self.done:
                stream.run(1)

    monkeypatch.setattr(jc, "_PinnedBuffer", Pinned)
    monkeypatch.setattr(jc, "_memcpy_async", memcpy)
    monkeypatch.setattr(jc, "_event", Event)
    check = jc.CountCheck(0)
    ring = check._ring.array
    return check, stream, memory


def test_counts_come_back_in_order_and_only_when_landed(fake):
    check, stream, memory = fake
    for done in range(3):
        memory[100 + done] = done + 1  # the count the program passed: correct
        check.enqueue(100 + done, done, 0)
    assert check.completed(block=False) == []  # nothing has run on the stream yet
    stream.run(2)  # the first copy and its event
    assert check.completed(block=False) == [(1, 0)]
    assert check.completed(block=True) == [(2, 1), (3, 2)]


def test_a_full_ring_never_reads_a_reused_slot(fake):
    check, stream, memory = fake
    n = jc.CountCheck.SLOTS + 6
    for done in range(n):  # the host runs far ahead of the stream
        memory[1000 + done] = done + 1
        check.enqueue(1000 + done, done, 0)
    stream.run()  # the GPU catches up: every copy has landed, reused slots overwritten
    got = check.completed(block=True)
    assert got == [(d + 1, d) for d in range(n)]  # every count matches its own call
