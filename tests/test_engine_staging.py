"""The engine's staging buffers under asynchronous copies, on CPU: a fake backend whose
D2H and H2D "streams" are threads copying in delayed slices (as DMA engines overlap).

fp16/bf16 weights are rounded into the gradient's staging buffer and uploaded from it
(``weights_in_grad_stage``); the next gradient copy into that buffer must wait for the
upload (``copy_to_host(free=...)``). Every path of the engine (plain, eager, micro-batch
accumulation, eager after accumulation, clipping, discarded gradients, a slot that gets
no gradient, a gradient copied right behind an eager update) must give the bits of a
synchronous backend with a separate weight buffer; with ``free`` ignored it must not.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from trainstream import contract as C
from trainstream.core import _host as E


class _Event:
    def __init__(self) -> None:
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()


class _Stream:
    """Runs queued copies in order, each after the events it waits for."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            waits, fn, ev = self._q.get()
            for w in waits:
                if w is not None:
                    w.synchronize()
            fn()
            ev._done.set()

    def put(self, waits, fn) -> _Event:
        ev = _Event()
        self._q.put((waits, fn, ev))
        return ev


class _Buf:
    def __init__(self, numel: int, dtype: str) -> None:
        self.array = np.zeros(numel, np.float32 if dtype == "float32" else np.uint16)
        self.handle = None
        self.pinned = True


def _sliced_copy(dst: np.ndarray, src: np.ndarray, delay: float, slices: int = 8) -> None:
    step = max(1, -(-len(dst) // slices))
    for b in range(0, len(dst), step):
        time.sleep(delay)
        dst[b:b + step] = src[b:b + step]


class AsyncBackend:
    """Parameters are uint16 (bf16 bit) arrays; an upload starts ``upload_delay`` late."""

    copy_keeps_source_alive = True

    def __init__(self, in_grad: bool = True, honour_free: bool = True, sync: bool = False,
                 upload_delay: float = 0.01) -> None:
        self.weights_in_grad_stage = in_grad
        self.honour_free = honour_free
        self.sync = sync
        self.upload_delay = upload_delay
        self.d2h, self.h2d = _Stream(), _Stream()

    def host_empty(self, numel, dtype, *, pinned, what):
        return _Buf(numel, dtype)

    def param_to_host_f32(self, param, out):
        out[:] = C.bf16_bits_to_f32(param)

    def record_compute(self, param):
        return None

    def copy_to_host(self, dst, src, after, *, free=None):
        if self.sync:
            dst.array[:] = src
            return None
        src = src.copy()
        waits = [after, free if self.honour_free else None]
        return self.d2h.put(waits, lambda: _sliced_copy(dst.array, src, 0.0001))

    def copy_to_device(self, dst, src, after):
        if self.sync:
            dst[:] = src.array
            return None

        def upload():
            time.sleep(self.upload_delay)
            _sliced_copy(dst, src.array, 0.0005)

        return self.h2d.put([after], upload)

    def wait_on_compute(self, event, param):
        if event is not None:
            event.synchronize()


SCENARIOS = ["plain", "eager", "micro3", "micro2_eager", "clip", "clip_micro2", "discard",
             "eager_then_grad", "no_grads", "eager_then_discard", "eager", "plain"]


def _train(backend, steps=len(SCENARIOS), seed=0):
    """Weights are taken right after each step's ``wait_ready`` (what the next forward
    would read), with no synchronize: a ``ready`` event that missed an upload shows."""
    rng = np.random.default_rng(seed)
    sizes = [20000, 9000, 777]
    params = [C.f32_to_bf16_bits(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    eng = E.HostPlacement(backend, threads=3, chunk_size=4096)
    sids = [eng.add_param(p, len(p), "bfloat16", "cuda") for p in params]
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.1)
    everyone = [(s, hp) for s in sids]

    def grads(update=None, order=1):
        for sid, n in list(zip(sids, sizes))[::order]:
            g = C.f32_to_bf16_bits((rng.standard_normal(n) * 0.1).astype(np.float32))
            eng.offload_grad(sid, g, "bfloat16", update=update)

    snapshots = []
    for t in range(steps + 1):
        eng.wait_ready(sids)  # the "forward"
        snapshots += [p.copy() for p in params]
        if t == steps:
            break
        kind = SCENARIOS[t % len(SCENARIOS)]
        if kind == "plain":
            grads()
            eng.step(everyone)
        elif kind == "eager":
            grads(update=hp, order=-1)
            eng.step(everyone)
        elif kind == "micro3":
            for _ in range(3):
                grads()
            eng.step(everyone)
        elif kind == "micro2_eager":
            grads()
            grads(update=hp)
            eng.step(everyone)
        elif kind == "clip":  # a multiplier per slot (torch's clip coefficient)
            grads()
            eng.step(everyone, coefs={s: 0.5 for s in sids})
        elif kind == "clip_micro2":
            grads()
            grads()
            eng.step(everyone, coefs={s: 0.25 for s in sids})
        elif kind == "discard":
            grads()
            eng.discard_grads()
            grads()
            eng.step(everyone)
        elif kind == "eager_then_grad":  # a gradient copied right behind an eager update
            grads(update=hp)
            grads()
            eng.step(everyone)
        elif kind == "no_grads":
            eng.step(everyone)
        elif kind == "eager_then_discard":
            grads(update=hp)
            grads()
            eng.discard_grads()
    eng.synchronize()
    for sid in sids:
        snapshots += list(eng.state(sid).values())
    eng.close()
    return snapshots


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    """Synchronous copies, a separate weight buffer."""
    return _train(AsyncBackend(in_grad=False, sync=True))


@pytest.mark.parametrize("in_grad", [True, False], ids=["weights-in-grad-staging", "separate"])
def test_async_copies_give_the_synchronous_bits(reference, in_grad):
    assert _same(_train(AsyncBackend(in_grad=in_grad)), reference)


def test_gradient_copy_that_ignores_the_upload_corrupts_the_weights(reference):
    """The test's teeth: a backend that drops ``free`` lets the copy behind an eager
    update overwrite the weights its upload (started 50 ms late) has yet to read."""
    assert not _same(_train(AsyncBackend(honour_free=False, upload_delay=0.05)), reference)
