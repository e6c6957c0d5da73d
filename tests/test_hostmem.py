"""Host state on 2 MiB pages (trainstream._hostmem, TRAINSTREAM_HOST_PAGES)."""

import gc

import numpy as np
import pytest
import torch

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


def test_small_arrays_are_plain_numpy():
    a = _hostmem.empty(1000, np.uint16)
    assert a.shape == (1000,) and a.dtype == np.uint16 and a.base is None


def test_setting_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_HOST_PAGES", "giant")
    with pytest.raises(ValueError, match="TRAINSTREAM_HOST_PAGES must be 'huge' or 'default'"):
        OffloadAdamW(torch.nn.Linear(4, 4).parameters())


@pytest.mark.parametrize("pages", ["huge", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bits_on_either_page_size(pages, dtype, monkeypatch):
    """A 1024x1024 layer (4 MiB of fp32 state per array, so the huge-page path is taken)
    trained against torch.optim.AdamW on an fp32 master, in both settings."""
    monkeypatch.setenv("TRAINSTREAM_HOST_PAGES", pages)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 8)).to(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    ts = OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, threads=2, chunk_size=1 << 16)
    st = ts._engine._slot(0)
    aligned = st.exp_avg.array.ctypes.data % _hostmem.HUGE_PAGE == 0
    if pages == "huge" and _hostmem._MADV is not None:
        assert aligned and st.master.array.ctypes.data % _hostmem.HUGE_PAGE == 0
    for step in range(5):
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(step)).to(dtype)
        loss = model(x).float().square().mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        for m, g in zip(master, grads):
            m.grad = g.float()
        loss.backward()
        ts.step()
        ts.zero_grad()
        ref.step()
        ts.synchronize()
        for p, m in zip(model.parameters(), master):
            assert torch.equal(p.detach(), m.detach().to(dtype))
    sd = ts.state_dict()
    for sid, m in enumerate(master):
        assert torch.equal(sd["state"][sid]["exp_avg_sq"], ref.state[m]["exp_avg_sq"])
    ts.close()


def test_jax_host_buffers_use_huge_pages(monkeypatch):
    pytest.importorskip("jax")
    from trainstream.backends._jax import _aligned_empty

    big = _aligned_empty((1024, 1024), np.float32)
    small = _aligned_empty((7, 3), np.float32)
    assert big.shape == (1024, 1024) and small.shape == (7, 3)
    assert small.ctypes.data % 64 == 0
    if _hostmem._MADV is not None:
        assert big.ctypes.data % _hostmem.HUGE_PAGE == 0
    monkeypatch.setenv("TRAINSTREAM_HOST_PAGES", "default")
    assert _aligned_empty((1024, 1024), np.float32).ctypes.data % 64 == 0
