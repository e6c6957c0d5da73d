"""Host state on 2 MiB pages (trainstream._hostmem)."""

import gc

import numpy as np
import pytest
import torch
from _torch_helpers import chunked, step_beside_master

from trainstream import _hostmem
from trainstream.torch import OffloadAdamW


def test_large_arrays_are_huge_page_aligned_and_independent():
    n = 3 * _hostmem.HUGE_PAGE // 4 + 5  # 1.5 huge pages of float32, not a whole number
    a = _hostmem.empty(n, np.float32)
    b = _hostmem.empty(n, np.float32)
    assert a.shape == (n,) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    if _hostmem._MADV is not None:
        assert a.ctypes.data % _hostmem.HUGE_PAGE == 0
    a[:] = 1.0
    b[:] = 2.0
    del b
    gc.collect()
    assert np.all(a == 1.0)  # the mapping lives as long as the array
    assert a[-1] == 1.0


def test_small_arrays_are_aligned_numpy(monkeypatch):
    a = _hostmem.empty(1000, np.uint16)
    assert a.shape == (1000,) and a.dtype == np.uint16 and a.ctypes.data % 64 == 0
    monkeypatch.setattr(_hostmem, "_MADV", None)  # an OS without the advice: big arrays too
    b = _hostmem.empty(1 << 20, np.float32, align=128)
    assert b.shape == (1 << 20,) and b.ctypes.data % 128 == 0


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _thp_madvise_works() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read() and _hostmem._MADV is not None
    except OSError:
        return False


@pytest.mark.skipif(not _thp_madvise_works(), reason="needs Linux transparent huge pages")
def test_alignment_slack_stays_out_of_memory():
    """Arrays of one huge page plus 4 KiB, written in full: their resident memory must be
    about their size, not a second huge page each for the slack of their mapping (the
    first version advised the whole mapping: 2 MiB more per array)."""
    n = (_hostmem.HUGE_PAGE + 4096) // 4
    keep = []
    before = _rss_kib()
    for _ in range(8):
        a = _hostmem.empty(n, np.float32)
        a[:] = 1.0
        keep.append(a)
    grown = _rss_kib() - before
    data = 8 * n * 4 // 1024
    assert grown < data * 1.3, f"{grown} KiB resident for {data} KiB of arrays"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bits_on_huge_pages(dtype, monkeypatch):
    """A 1024x1024 layer (4 MiB of fp32 state per array, so the huge-page path is taken)
    trained with master_weights=True against torch.optim.AdamW on an fp32 master."""
    calls = []
    real_empty = _hostmem.empty
    monkeypatch.setattr(_hostmem, "empty", lambda *a, **k: calls.append(a[0]) or real_empty(*a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 8)).to(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    with chunked(1 << 16):
        ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=2, master_weights=True)
    st = ts._engine.host._slot(0)
    # moments (and the bf16 weights' master) through _hostmem
    assert 1024 * 1024 in calls
    if _hostmem._MADV is not None:
        assert st.exp_avg.array.ctypes.data % _hostmem.HUGE_PAGE == 0
        assert st.master.array.ctypes.data % _hostmem.HUGE_PAGE == 0
    for step in range(5):
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(step)).to(dtype)
        step_beside_master(model, master, ref, ts, model(x).float().square().mean())
        ts.synchronize()
        for p, m in zip(model.parameters(), master):
            assert torch.equal(p.detach(), m.detach().to(dtype))
    sd = ts.state_dict()
    for sid, m in enumerate(master):
        assert torch.equal(sd["state"][sid]["exp_avg_sq"], ref.state[m]["exp_avg_sq"])
    ts.close()

