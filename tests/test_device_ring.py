"""The device placement's staging ring on CPU (no CuPy, no GPU): the CUDA layer faked with copies that run at once,
the kernels simulated by the recipes' NumPy emulation (tests/_cuda_recipes_ref.py) on the real memory the pointers
address; staged updates against zero-copy ones, the ring's ordering, its failures."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _device_kernels as dk
from trainstream import _device_recipes as R
from trainstream.core import _device as ge
from trainstream.core import _ring
import _cuda_recipes_ref as X
from _device_fakes import _Backend, _Event

HP = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0)


# -- the staging ring: the kernel simulated by the contract on real memory -----------------------


def _view(ptr, n, dtype):
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * max(1, n * dtype.itemsize)).from_address(ptr), dtype, count=n)


def _storage(dt):
    return np.float32 if dt == "float32" else np.uint16


def _as_f32(ptr, n, dt):
    if dt == "float32":
        return _view(ptr, n, np.float32).copy()
    bits = _view(ptr, n, np.uint16)
    return bits.view(np.float16).astype(np.float32) if dt == "float16" else C.bf16_bits_to_f32(bits)


class _FakeCuda:
    """trainstream._cuda's context and events: copies run at once (ctypes.memmove), every
    call is logged as (op, stream, ...); events are complete when recorded."""

    def __init__(self):
        self.log, self.streams, self.events = [], itertools.count(100), itertools.count()
        self.complete = True  # what an event's query() answers

    def context(self, device):
        return self

    def create_stream(self):
        return next(self.streams)

    def destroy_stream(self, stream):
        self.log.append(("destroy", stream))

    def stream_synchronize(self, stream):
        self.log.append(("sync", stream))

    def stream_wait_event(self, stream, event):
        self.log.append(("wait", stream, event.id))

    def memcpy_htod_async(self, dst, src, nbytes, stream):
        self.log.append(("h2d", stream, dst))
        ctypes.memmove(dst, src, nbytes)

    def memcpy_dtoh_async(self, dst, src, nbytes, stream):
        self.log.append(("d2h", stream, src))
        ctypes.memmove(dst, src, nbytes)

    def Event(self, ctx, stream):  # noqa: N802 - stands for the class
        ev = _Event()
        self.log.append(("record", stream, ev.id))
        ev.query = lambda: self.complete
        return ev


@pytest.fixture
def simulated(monkeypatch):
    """Real host memory behind every pointer; the launcher applies the contract's update
    (torch/cuda) to what the pointers address; GPU allocations and the CUDA layer faked
    (``fake.refuse = True`` refuses GPU allocations). Returns (fake CUDA, launch log)."""
    keep, fake, launched = [], _FakeCuda(), []
    fake.refuse = False

    def alloc_mapped(nbytes, device=None):
        a = np.zeros(nbytes // 4, np.float32)
        keep.append(a)
        return a.ctypes.data, a.ctypes.data, lambda: None

    class Mem:
        def __init__(self, nbytes):
            self.data = np.full(nbytes // 4, np.nan, np.float32)
            self.dev_ptr, self.nbytes, self.freed = self.data.ctypes.data, nbytes, False

        def free(self):
            self.freed = True

    def alloc_device(nbytes, device=None):
        if fake.refuse:
            raise MemoryError(f"could not allocate {nbytes} bytes of GPU memory")
        fake.mems = getattr(fake, "mems", []) + [Mem(nbytes)]
        return fake.mems[-1]

    def kernel(recipe, gd, items, stream=0, *, device=None, max_blocks=None):
        items = [R.TorchItem(*it) for it in items]
        assert len(items) <= dk.MULTI_MAX
        launched.append((stream, [it.m for it in items], [it.n for it in items]))
        sd, pd = R.state_dtype(recipe), recipe.dtype
        for it in items:
            n = it.n
            p = _as_f32(it.master, n, "float32") if it.master else _as_f32(it.param, n, pd)
            x = _as_f32(it.vmax, n, sd) if it.vmax else None
            p2, m2, v2, x2, _ = X.recipe_step(recipe, p, _as_f32(it.grad, n, gd), _as_f32(it.m, n, sd),
                                              _as_f32(it.v, n, sd), x, it.scalars, it.flags, grad_dtype=gd,
                                              base=it.base)
            for ptr, vals, dt in ((it.m, m2, sd), (it.v, v2, sd), (it.vmax, x2, sd), (it.master, p2, "float32"),
                                  (it.param, X.rnd(p2, pd), pd)):
                if ptr:
                    _view(ptr, n, _storage(dt))[:] = R._round_to_state(vals, dt)
        return len(items)

    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "alloc_mapped", alloc_mapped)
    monkeypatch.setattr(dk, "alloc_device", alloc_device)
    monkeypatch.setattr(R, "launch_torch_multi", kernel)
    monkeypatch.setattr(ge._cuda, "context", fake.context)
    monkeypatch.setattr(ge._cuda, "Event", fake.Event)
    monkeypatch.setattr(_ring, "RING_ELEMS", 64)  # small buffers: many pieces from small tensors
    return fake, launched


class _MemBackend(_Backend):
    """Tensors are NumPy arrays (fp32, or bf16 bits as uint16) at real addresses."""

    def data_ptr(self, tensor):
        return tensor.ctypes.data

    def param_to_host_f32(self, param, out):  # fp32, fp16, or bf16 as its uint16 bits
        out[:] = param.astype(np.float32) if param.dtype != np.uint16 else C.bf16_bits_to_f32(param)


def _stored(x, dt):
    """float values as a parameter of dtype dt: float32, float16, or bf16 bits."""
    return x if dt == "float32" else (x.astype(np.float16) if dt == "float16" else C.f32_to_bf16_bits(x))


_REC = {  # recipes of the ring's layout (None: the default, foreach on an fp32 master)
    "bf16": dict(impl="foreach"), "f16fa": dict(impl="fused", amsgrad=True, decoupled=False),
    "bf16m": dict(impl="fused", master=True), "f32sa": dict(impl="single", amsgrad=True, maximize=True),
    "bf16sa": dict(impl="single", amsgrad=True, decoupled=False)}
LAYOUT = ([("float32", 150, None), ("float32", 3, None), ("float32", 0, None), ("bfloat16", 17, None),
           ("bfloat16", 64, None), ("bfloat16", 130, None), ("bfloat16", 150, "bf16"), ("float16", 97, "f16fa"),
           ("bfloat16", 200, "bf16m"), ("float32", 70, "f32sa"), ("bfloat16", 33, "bf16sa")]
          + [("float32", 5, None)] * 40 + [("float32", 64, None), ("float32", 1, None)])
HPW = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.1)


def _run_layout(staged: bool, steps: int = 3):
    rng = np.random.default_rng(0)
    be = _MemBackend()
    eng = ge.DevicePlacement(be)
    eng.staged = staged
    params, sids = [], []
    for dt, n, rk in LAYOUT:
        w = rng.standard_normal(n).astype(np.float32)
        params.append(_stored(w, dt))
        rec = None if rk is None else R.TorchRecipe(platform="cuda", dtype=dt, **_REC[rk])
        sids.append(eng.add_param(params[-1], n, dt, "cuda", recipe=rec))
    for step in range(steps):
        grads = [_stored((rng.standard_normal(n) * 1e-2).astype(np.float32), dt) for dt, n, _ in LAYOUT]
        eng.step([(sid, HP if rk is None else HPW, g, dt) for sid, g, (dt, _, rk) in zip(sids, grads, LAYOUT)])
    return eng, params, [eng.state(sid) for sid in sids]


def test_staged_updates_equal_zero_copy_updates_for_every_piece_layout(simulated):
    """Tensors spanning several ring buffers, many small ones (more than MULTI_MAX pieces per
    buffer), empty ones, fp32 and bf16 with masters, 3 steps (the ring wraps): the same
    weights, moments and masters as the kernel reading the mapped state directly."""
    fake, launched = simulated
    staged, p_s, st_s = _run_layout(True)
    launched_staged = list(launched)
    launched.clear()
    direct, p_d, st_d = _run_layout(False)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(p_s, p_d))
    for a, b in zip(st_s, st_d):
        assert sorted(a) == sorted(b) and a["step"] == b["step"] == 3
        assert all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a if k != "step")
    assert any(np.abs(st["exp_avg"].astype(np.float32)).sum() > 0 for st in st_s)  # the updates did something
    assert sum("max_exp_avg_sq" in st for st in st_s) == 3 and st_s[7]["exp_avg"].dtype == np.uint16
    ring = staged._ring
    bases = {m.dev_ptr for m in ring.mem}
    assert all(any(0 <= ptr - b < 3 * 4 * 64 for b in bases) for _, ms, _ in launched_staged for ptr in ms)
    assert all(any((ptr - b) % 64 == 0 for b in bases)  # arrays start 64-byte aligned
               for _, ms, _ in launched_staged for ptr in ms)
    assert max(len(ns) for _, _, ns in launched_staged) > 1  # several pieces in one launch
    assert not any(any(0 <= ptr - b < 3 * 4 * 64 for b in bases) for _, ms, _ in launched for ptr in ms)
    assert staged.stats()["staging_ring_bytes"] == 3 * 3 * 4 * 64 and direct.stats()["staging_ring_bytes"] == 0
    staged.close()
    assert all(m.freed for m in ring.mem) and [op for op, *_ in fake.log[-2:]] == ["destroy", "destroy"]
    direct.close()


def test_the_ring_orders_its_copies(simulated):
    """Per buffer: copies in (ring's h2d stream), the kernel waits for them on the update
    stream, copies back wait for the kernel (d2h stream); a buffer is refilled only after its
    last copy back, and a slot's state copied in only after its previous copy back."""
    fake, _ = simulated
    eng, _, _ = _run_layout(True, steps=2)
    ring = eng._ring
    h2d, d2h = ring.h2d, ring.d2h
    recorded = {ev: st for op, st, *rest in fake.log if op == "record" for ev in rest}
    waits = [(st, ev) for op, st, *rest in fake.log if op == "wait" for ev in rest]
    assert (0, next(ev for ev, st in recorded.items() if st == h2d)) in waits  # kernel after its copies in
    assert any(st == d2h and recorded[ev] == 0 for st, ev in waits)  # copies back after the kernel
    refills = [ev for st, ev in waits if st == h2d]
    assert refills and all(recorded[ev] == d2h for ev in refills)  # only ever after copies back
    ops = [(op, st) for op, st, *_ in fake.log if op in ("h2d", "d2h")]
    assert {st for op, st in ops if op == "h2d"} == {h2d} and {st for op, st in ops if op == "d2h"} == {d2h}
    eng.close()


def test_a_slots_state_is_copied_in_after_its_last_copy_back(simulated):
    """With copies still in flight (events not complete), the next step copies each slot's
    state in only after the ring's H2D stream has waited for that slot's previous copy back
    (one buffer per step here: the second step fills another buffer, no refill wait)."""
    fake, _ = simulated
    fake.complete = False
    be = _MemBackend()
    eng = ge.DevicePlacement(be)
    params = [np.zeros(n, np.float32) for n in (3, 40)]
    sids = [eng.add_param(p, p.size, "float32", "cuda") for p in params]
    ups = [(sid, HP, np.ones(p.size, np.float32), "float32") for sid, p in zip(sids, params)]
    eng.step(ups)
    before = {eng._slot(sid).copied_back.id for sid in sids}
    h2d, start = eng._ring.h2d, len(fake.log)
    eng.step(ups)
    waited = {ev for op, st, *rest in fake.log[start:] if op == "wait" and st == h2d for ev in rest}
    assert len(before) == 1 and before <= waited and eng._ring.next == 2
    assert all(eng._slot(sid).copied_back.id not in before for sid in sids)
    eng.close()


def test_no_gpu_memory_for_the_ring_warns_and_reads_over_pcie(simulated):
    fake, launched = simulated
    fake.refuse = True
    with pytest.warns(RuntimeWarning, match="no GPU memory for the staging ring"):
        eng, params, states = _run_layout(True, steps=1)
    assert eng._ring is None and not eng.staged and eng.stats()["staging_ring_bytes"] == 0
    fake.refuse = False
    launched.clear()
    _, params_d, states_d = _run_layout(False, steps=1)
    assert all(np.array_equal(a, b) for a, b in zip(params, params_d))
    eng.close()


def test_the_ring_frees_what_it_made_when_a_cuda_call_fails(simulated):
    """A second stream refused: the buffers and the first stream are released before the
    error reaches the caller. A failed wait in close(): buffers and streams released anyway;
    the placement's close() after its own failed wait still releases the ring and the slots."""
    fake, _ = simulated
    streams = iter([100])

    def create_stream():
        for st in streams:
            return st
        raise RuntimeError("cuStreamCreate failed: CUDA_ERROR_OUT_OF_MEMORY")

    fake.create_stream = create_stream
    with pytest.raises(RuntimeError, match="cuStreamCreate failed"):
        _ring.StagingRing(0, dk)
    assert len(fake.mems) == _ring.RING_DEPTH and all(m.freed for m in fake.mems) and ("destroy", 100) in fake.log
    del fake.create_stream

    def failed_wait(stream):
        raise RuntimeError("cuStreamSynchronize failed: CUDA_ERROR_LAUNCH_FAILED")

    eng, _, _ = _run_layout(True, steps=1)
    ring = eng._ring
    bufs, streams, fake.log = list(ring.mem), (ring.h2d, ring.d2h), []
    fake.stream_synchronize = failed_wait
    eng._slots[0].settle = lambda: failed_wait(0)  # the placement's own wait fails first
    with pytest.raises(RuntimeError, match="cuStreamSynchronize failed"):
        eng.close()
    assert eng.closed and eng._ring is None and eng._slots == [] and ring.mem == []
    assert all(m.freed for m in bufs) and [st for op, st in fake.log if op == "destroy"] == list(streams)
