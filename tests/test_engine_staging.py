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

import os
import queue
import threading
import time

import numpy as np
import pytest

from trainstream import _contract as C
from trainstream import _engine as E


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
        self.copy_spans = True
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

    def copy_to_host(self, dst, src, after, *, free=None, span=None):
        b, e = span if span is not None else (0, len(src))
        if self.sync:
            dst.array[b:e] = src[b:e]
            return None
        src = src[b:e].copy()
        waits = [after, free if self.honour_free else None]
        return self.d2h.put(waits, lambda: _sliced_copy(dst.array[b:e], src, 0.0001))

    def copy_to_device(self, dst, src, after, *, span=None):
        b, e = span if span is not None else (0, len(dst))
        if self.sync:
            dst[b:e] = src.array[b:e]
            return None

        def upload():
            time.sleep(self.upload_delay)
            _sliced_copy(dst[b:e], src.array[b:e], 0.0005)

        return self.h2d.put([after], upload)

    def wait_on_compute(self, event, param):
        if event is not None:
            event.synchronize()

    def all_reduce_sum(self, value):
        return value


SCENARIOS = ["plain", "eager", "micro3", "micro2_eager", "clip", "clip_micro2", "discard",
             "eager_then_grad", "no_grads", "eager_then_discard", "eager", "plain"]


def _engine(backend, pieces: int, **kw) -> E.Engine:
    """An engine built with TRAINSTREAM_COPY_PIECE_CHUNKS=pieces (whatever the caller's
    environment says)."""
    old = os.environ.get("TRAINSTREAM_COPY_PIECE_CHUNKS")
    os.environ["TRAINSTREAM_COPY_PIECE_CHUNKS"] = str(pieces)
    try:
        return E.Engine(backend, **kw)
    finally:
        if old is None:
            del os.environ["TRAINSTREAM_COPY_PIECE_CHUNKS"]
        else:
            os.environ["TRAINSTREAM_COPY_PIECE_CHUNKS"] = old


def _train(backend, steps=len(SCENARIOS), seed=0, pieces=0):
    """Weights are taken right after each step's ``wait_ready`` (what the next forward
    would read), with no synchronize: a ``ready`` event that missed an upload shows."""
    rng = np.random.default_rng(seed)
    sizes = [20000, 9000, 777]
    params = [C.f32_to_bf16_bits(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    eng = _engine(backend, pieces, threads=3, chunk_elems=4096)
    sids = [eng.add_param(p, len(p), "bfloat16", "cuda") for p in params]
    assert [eng._slot(s).pieces for s in sids] == [bool(pieces), bool(pieces), False]
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
        elif kind == "clip":
            grads()
            eng.step(everyone, max_grad_norm=0.5)
        elif kind == "clip_micro2":
            grads()
            grads()
            eng.step(everyone, max_grad_norm=0.5)
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
        snapshots += list(eng.state(sid)[:3])
    eng.close()
    return snapshots


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference():
    """Synchronous copies, a separate weight buffer."""
    return _train(AsyncBackend(in_grad=False, sync=True))


@pytest.mark.parametrize("pieces", [0, 2], ids=["whole", "pieces-of-2-chunks"])
@pytest.mark.parametrize("in_grad", [True, False], ids=["weights-in-grad-staging", "separate"])
def test_async_copies_give_the_synchronous_bits(reference, in_grad, pieces):
    """Also with gradients copied and weights uploaded in pieces
    (``TRAINSTREAM_COPY_PIECE_CHUNKS``: the 20000- and 9000-element slots go in 3 and 2
    pieces, the 777-element one whole)."""
    assert _same(_train(AsyncBackend(in_grad=in_grad), pieces=pieces), reference)


def test_gradient_copy_that_ignores_the_upload_corrupts_the_weights(reference):
    """The test's teeth: a backend that drops ``free`` lets the copy behind an eager
    update overwrite the weights its upload (started 50 ms late) has yet to read."""
    assert not _same(_train(AsyncBackend(honour_free=False, upload_delay=0.05)), reference)


class _SlowPieces(AsyncBackend):
    """Each gradient piece takes ~20 ms to land, and says when it landed."""

    def __init__(self) -> None:
        super().__init__()
        self.landed_at: list[float] = []

    def copy_to_host(self, dst, src, after, *, free=None, span=None):
        b, e = span if span is not None else (0, len(src))
        src = src[b:e].copy()

        def copy():
            _sliced_copy(dst.array[b:e], src, 0.0025)
            self.landed_at.append(time.perf_counter())

        return self.d2h.put([after, free], copy)


def test_update_starts_before_the_last_piece_lands(monkeypatch):
    """The point of copies in pieces: the first chunk's update runs as soon as its piece is
    in, not after the whole gradient."""
    started: list[float] = []
    real = E.K.adamw_chunk

    def timed(*args, **kwargs):
        started.append(time.perf_counter())
        return real(*args, **kwargs)

    monkeypatch.setattr(E.K, "adamw_chunk", timed)
    backend = _SlowPieces()
    eng = _engine(backend, 1, threads=2, chunk_elems=4096)
    n = 5 * 4096
    sid = eng.add_param(np.zeros(n, np.uint16), n, "bfloat16", "cuda")
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.1)
    eng.offload_grad(sid, np.ones(n, np.uint16), "bfloat16", update=hp)
    eng.synchronize()
    eng.close()
    assert len(backend.landed_at) == 5 and len(started) == 5
    assert min(started) < max(backend.landed_at) - 0.03  # ~80 ms of copies still to land


def test_failed_chunk_in_pieces_uploads_the_other_pieces_only():
    """With copies in pieces a failed chunk's piece stays out and the pieces whose chunks
    ran go up (the device weights are then partly new: the WorkerError says to reload a
    checkpoint); without pieces nothing goes up (tests/test_torch_optimizer.py)."""
    backend = AsyncBackend(upload_delay=0.0)
    eng = _engine(backend, 1, threads=2, chunk_elems=4096)
    n = 3 * 4096
    param = np.zeros(n, np.uint16)
    sid = eng.add_param(param, n, "bfloat16", "cuda")
    real = E.K.adamw_chunk

    def fail_middle(variant, p, m, v, g, gkind, out, okind, b, e, *rest):
        if b == 4096:
            raise FloatingPointError("injected")
        return real(variant, p, m, v, g, gkind, out, okind, b, e, *rest)

    E.K.adamw_chunk = fail_middle
    try:
        hp = C.AdamWHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.1)
        eng.offload_grad(sid, C.f32_to_bf16_bits(np.ones(n, np.float32)), "bfloat16", update=hp)
        with pytest.raises(E.WorkerError, match="injected"):
            eng.synchronize()
    finally:
        E.K.adamw_chunk = real
    eng.drain()
    assert (param[:4096] != 0).all() and (param[4096:8192] == 0).all() and (param[8192:] != 0).all()
    eng.close()
