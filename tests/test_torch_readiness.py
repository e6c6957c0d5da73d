"""Readiness: ``step()`` returns once the host update has run (its uploads queued) and makes
the current stream wait, on the GPU, for those uploads: every read after it sees the new
weights, the host never waits for the transfers, the device never waits for work the host
has not queued yet (trainstream.core._host, module docstring 4.). A failed update never
leaves anything waiting. ``overlap_forward=model`` instead lets that model's forward wait
per module.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from trainstream import _host_kernels as K  # noqa: E402
from trainstream.core._host import WorkerError  # noqa: E402
from trainstream.torch import OffloadAdamW  # noqa: E402


def _pair(device, **kw):
    def mk():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).to(device)

    ref, ours = mk(), mk()
    return (ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
            ours, OffloadAdamW(ours.parameters(), lr=1e-2, threads=2, **kw))


def _boom(*a, **k):
    raise FloatingPointError("injected")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_failed_update_leaves_nothing_waiting(device, monkeypatch):
    """Every update raises: step() returns, the weights stay as they were (nothing
    uploaded), a forward and a device-wide synchronize go through, and the failure is
    raised by the optimizer's next call."""
    _, _, ours, opt = _pair(device, speculate=False)  # updates at step() (speculative: test_torch_speculate.py)
    before = [p.detach().clone() for p in ours.parameters()]
    monkeypatch.setattr(K, "adamw_chunk", _boom)
    x = torch.randn(32, 64, device=device)
    ours(x).square().mean().backward()
    opt.step()
    y = ours(x)
    if device == "cuda":
        done = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
        assert done.wait(30), "the compute stream hangs after a failed update"
    assert torch.isfinite(y).all()
    for p, b in zip(ours.parameters(), before):
        assert torch.equal(p, b)
    with pytest.raises(WorkerError, match="injected"):
        opt.step()
    opt.close()


@pytest.mark.gpu
def test_step_does_not_wait_for_the_transfers_and_reads_are_current():
    """With the upload stream held (~0.5 s of GPU sleep) step() returns at once; a read
    right after it on the current stream still sees the new weights. The first step is not
    held: it loads the compiled kernels from Numba's cache (~0.7 s once per process on an H100,
    experiments/diag_step_block.py)."""
    ref, ropt, ours, opt = _pair("cuda")
    x = torch.randn(32, 64, device="cuda")
    for i in range(4):
        for m, o in ((ref, ropt), (ours, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            if o is opt and i > 0:
                with torch.cuda.stream(opt._engine.backend.h2d):
                    torch.cuda._sleep(1 << 30)
                t0 = time.perf_counter()
                o.step()
                took = time.perf_counter() - t0
                assert took < 0.2, f"step() blocked for {took:.3f} s"
            else:
                o.step()
        for p, q in zip(ref.parameters(), ours.parameters()):
            assert torch.equal(p, q)
    opt.close()


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlap_forward_gates_the_model_only(device, eager):
    """overlap_forward=model: its forward waits per module (its output right every step);
    a read outside it needs synchronize(), after which the weights match too."""
    ref, ropt, ours, _ = _pair(device)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, threads=2, overlap_forward=ours)
    x = torch.randn(32, 64, device=device)
    for _ in range(10):
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
    assert opt.stats()["ready_stall_ms_total"] >= 0
    opt.close()
