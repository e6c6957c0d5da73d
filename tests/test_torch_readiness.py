"""Readiness: after ``step()`` the current stream waits, on the GPU, for a flag that the
upload stream writes once an epoch's uploads are queued (trainstream.core._host, module
docstring 4.). The flag is always written: after a failed update, a dropped batch,
``close()``; a later owner of the same flag starts above every value written. On the CPU
through a stand-in backend whose flag is plain host memory; on CUDA for real (``gpu``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trainstream import _host_kernels as K  # noqa: E402
from trainstream import contract as C  # noqa: E402
from trainstream.core._host import HostPlacement, WorkerError  # noqa: E402
from trainstream.torch import OffloadAdamW  # noqa: E402
from trainstream.torch._backend import TorchBackend  # noqa: E402

HP = C.AdamWHyperParams(1e-2, 0.9, 0.999, 1e-8, 0.0)


class _HostFlag:
    def __init__(self):
        self.host = np.zeros(1, np.uint32)
        self.released = 0

    def release(self):
        self.released += 1


class FlagBackend(TorchBackend):
    """CPU buffers and copies; a flag in host memory, written at once (as if the upload
    stream had run), every wait recorded."""

    def __init__(self, flag=None):
        super().__init__(torch.device("cpu"))
        self.flag = flag or _HostFlag()
        self.waits: list[int] = []

    def new_flag(self):
        return self.flag

    def signal_flag(self, flag, value):
        assert value > int(flag.host[0]) or value < 2, "flag writes only go up"
        flag.host[0] = value

    def wait_flag(self, flag, value):
        self.waits.append(value)


def _placement(backend, n=3, numel=5000, threads=2):
    eng = HostPlacement(backend, threads=threads, chunk_elems=4096)
    for _ in range(n):
        eng.add_param(torch.zeros(numel), numel, "float32", "cpu")
    return eng


def _step(eng, n=3):
    for sid in range(n):
        eng.offload_grad(sid, torch.randn(eng._slot(sid).numel), "float32")
    eng.step([(sid, HP) for sid in range(n)])
    eng.wait_step()


def _released(backend):
    return all(int(backend.flag.host[0]) >= w for w in backend.waits)


def test_every_wait_is_released_by_its_epoch():
    backend = FlagBackend()
    eng = _placement(backend)
    for _ in range(4):
        _step(eng)
    eng.drain()
    assert set(backend.waits) <= {1, 2, 3, 4} and int(backend.flag.host[0]) == 4 and _released(backend)
    eng.wait_step()  # nothing queued since: no new epoch, nothing to wait for
    assert int(backend.flag.host[0]) == 4 and _released(backend)
    eng.close()
    assert backend.flag.released == 1


def test_a_failed_update_still_releases_its_epoch(monkeypatch):
    backend = FlagBackend()
    eng = _placement(backend)

    def boom(*a, **k):
        raise FloatingPointError("injected")

    monkeypatch.setattr(K, "adamw_chunk", boom)
    _step(eng)
    eng.drain()
    assert _released(backend)
    with pytest.raises(WorkerError, match="injected"):
        eng.check_error()
    eng.close()


def test_a_dropped_chained_batch_releases_its_epoch(monkeypatch):
    """The second update of a slot is chained behind the first; its submission fails (the
    worker that would submit it raises): it is dropped, and its epoch still written."""
    backend = FlagBackend()
    eng = _placement(backend, n=1)
    gate = threading.Event()
    real = K.adamw_chunk

    def slow(*a, **k):
        gate.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(K, "adamw_chunk", slow)
    slot = eng._slot(0)
    eng.offload_grad(0, torch.randn(slot.numel), "float32", update=HP)  # first batch, held
    slot.grad_state = 1  # a second update queued behind it (chained), staged by hand
    real_submit = eng._submit_batch
    monkeypatch.setattr(eng, "_submit_batch", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no")))
    eng.step([(0, HP)])
    eng.wait_step()
    assert slot.chain  # chained behind the held batch
    gate.set()
    eng.drain()
    eng._submit_batch = real_submit
    assert _released(backend) and int(backend.flag.host[0]) >= 1
    with pytest.raises(WorkerError, match="no"):
        eng.check_error()
    eng.close()


def test_close_releases_the_flag_above_every_write_and_the_next_owner_starts_there():
    backend = FlagBackend()
    eng = _placement(backend)
    _step(eng)
    _step(eng)
    eng.close()
    last = int(backend.flag.host[0])
    assert _released(backend) and last >= 2
    again = FlagBackend(flag=backend.flag)  # the pool hands the word out again
    eng2 = _placement(again)
    _step(eng2)
    assert again.waits[0] > last
    eng2.close()


# -- CUDA ------------------------------------------------------------------------------------


def _cuda_pair(mode="cpu", **kw):
    torch.manual_seed(0)
    mk = lambda: torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).cuda()  # noqa: E731
    ref, ours = mk(), mk()
    ours.load_state_dict(ref.state_dict())
    return (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
            ours, OffloadAdamW(ours.parameters(), lr=1e-2, mode=mode, threads=2, **kw))


@pytest.mark.gpu
def test_step_does_not_block_the_host_and_reads_are_current():
    """With the upload stream held (0.5 s of GPU sleep), step() returns at once; a read
    right after it on the current stream still sees the new weights."""
    ref, ropt, ours, opt = _cuda_pair()
    assert opt._engine.host._flag is not None, "stream memory operations unavailable here"
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):
        for m, o in ((ref, ropt), (ours, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            if o is opt:
                with torch.cuda.stream(opt._engine.backend.h2d):
                    torch.cuda._sleep(1 << 30)
                t0 = time.perf_counter()
                o.step()
                took = time.perf_counter() - t0
            else:
                o.step()
        assert took < 0.2, f"step() blocked for {took:.3f} s"
        for p, q in zip(ref.parameters(), ours.parameters()):
            assert torch.equal(p, q)
    opt.close()


@pytest.mark.gpu
def test_a_failed_update_never_hangs_the_gpu(monkeypatch):
    ref, ropt, ours, opt = _cuda_pair()
    before = [p.detach().clone() for p in ours.parameters()]

    def boom(*a, **k):
        raise FloatingPointError("injected")

    monkeypatch.setattr(K, "adamw_chunk", boom)
    x = torch.randn(32, 64, device="cuda")
    ours(x).square().mean().backward()
    opt.step()
    y = ours(x)  # queued behind the wait on the flag
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    assert done.wait(30), "the compute stream hangs on the flag of a failed update"
    assert torch.isfinite(y).all()
    for p, b in zip(ours.parameters(), before):
        assert torch.equal(p, b)  # nothing uploaded
    with pytest.raises(WorkerError, match="injected"):
        opt.step()
    opt.close()


@pytest.mark.gpu
def test_without_stream_memory_operations_step_blocks_instead(monkeypatch):
    from trainstream import _cuda

    monkeypatch.setattr(_cuda.Context, "stream_memops", property(lambda self: False))
    ref, ropt, ours, opt = _cuda_pair()
    assert opt._engine.host._flag is None
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):
        for m, o in ((ref, ropt), (ours, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for p, q in zip(ref.parameters(), ours.parameters()):
            assert torch.equal(p, q)
    opt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True])
def test_overlap_forward_gates_the_model_only(eager):
    """overlap_forward=model: the forward waits per module (weights right); a read outside
    it needs synchronize(), after which it matches too."""
    ref, ropt, ours, opt = _cuda_pair(overlap_forward=None)
    opt.close()
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, threads=2, overlap_forward=ours)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(20):
        out_ref, out = ref(x), ours(x)
        assert torch.equal(out_ref, out)
        for o, y in ((ropt, out_ref), (opt, out)):
            o.zero_grad()
            if eager and o is opt:
                with opt.last_micro_batch():
                    y.square().mean().backward()
            else:
                y.square().mean().backward()
            o.step()
    opt.synchronize()
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    opt.close()
