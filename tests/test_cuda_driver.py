"""The ctypes CUDA driver layer on a machine without one (CI): clear failures, no crash."""

import ctypes

import pytest

from trainstream import _cuda as drv


def test_available_is_a_bool():
    assert drv.available() in (True, False)


def test_error_text_names_the_call_and_the_driver_error():
    class FakeLib:
        def cuGetErrorName(self, res, out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_VALUE"
            return 0

        def cuGetErrorString(self, res, out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"invalid argument"
            return 0

    drv._check(0, "cuEventRecord", FakeLib())  # success: silent
    with pytest.raises(drv.CudaDriverError, match=r"cuEventRecord failed: CUDA_ERROR_INVALID_VALUE \(1\): invalid argument"):
        drv._check(1, "cuEventRecord", FakeLib())


@pytest.mark.skipif(drv.available(), reason="this machine has a CUDA driver")
def test_context_without_driver_raises_clearly():
    with pytest.raises(drv.CudaDriverError, match="CUDA driver"):
        drv.Context(0)


class _FakeContext:
    """Answers cuEventQuery with NOT_READY ``pending`` times, then success; counts calls."""

    def __init__(self, pending: int):
        self.pending, self.calls = pending, []

    def call(self, name, *args, release_gil=False):
        self.calls.append((name, release_gil))
        if name == "cuEventQuery" and self.pending > 0:
            self.pending -= 1
            return drv._CUDA_ERROR_NOT_READY
        return 0


def _fake_event(ctx):
    ev = object.__new__(drv.Event)
    ev._ctx, ev.handle, ev._done = ctx, 1234, False
    return ev


def test_event_waits_with_the_gil_released_only_while_pending():
    ctx = _FakeContext(pending=2)
    ev = _fake_event(ctx)
    assert ev.query() is False
    ev.synchronize()  # still pending at its query: blocks through the GIL-releasing call
    assert ctx.calls == [("cuEventQuery", False), ("cuEventQuery", False), ("cuEventSynchronize", True)]
    ev.synchronize()  # seen complete: no driver call any more
    assert ev.query() is True
    assert len(ctx.calls) == 3
    ev.handle = None  # nothing to destroy in __del__


def test_event_already_complete_never_releases_the_gil():
    ctx = _FakeContext(pending=0)
    ev = _fake_event(ctx)
    ev.synchronize()
    ev.synchronize()
    assert ctx.calls == [("cuEventQuery", False)]
    ev.handle = None


@pytest.mark.gpu
def test_mapped_memory_read_and_written_by_the_device():
    """alloc_mapped gives host memory that the device reads and writes at dev_ptr; a failed
    allocation is a MemoryError naming the size; free is idempotent."""
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = drv.context(dev.index)
    assert drv.context(dev.index) is ctx
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes"):
        ctx.alloc_mapped(2**60)
    buf = ctx.alloc_mapped(16)
    words = (ctypes.c_float * 4).from_address(buf.host_ptr)
    words[:] = [1.0, 2.0, 3.0, 4.0]
    src = torch.tensor([5.0, 6.0, 7.0, 8.0], device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    back = torch.empty(4, device=dev)
    ctx.memcpy_htod_async(back.data_ptr(), buf.host_ptr, 16, stream)  # the device reads it
    assert back.tolist() == [1.0, 2.0, 3.0, 4.0]
    ctx.memcpy_dtoh_async(buf.host_ptr, src.data_ptr(), 16, stream)  # and writes it
    ctx.stream_synchronize(stream)
    assert list(words) == [5.0, 6.0, 7.0, 8.0]
    torch.cuda.synchronize(dev)
    del words
    buf.free()
    buf.free()  # idempotent


@pytest.mark.gpu
def test_device_memory_zeroed_written_read_and_freed():
    """alloc_device gives GPU memory; zero, from_host and to_host (pageable NumPy arrays)
    block until done, in stream order (the kernels that use dev_ptr: test_torch_gpu); a failed
    allocation is a MemoryError naming the size; free gives the memory back, is
    idempotent, and a copy after it raises."""
    torch = pytest.importorskip("torch")
    import numpy as np

    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = drv.context(dev.index)
    stream = torch.cuda.current_stream(dev).cuda_stream
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes of GPU memory"):
        ctx.alloc_device(2**60)
    n = 1 << 26  # 256 MiB
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    buf = ctx.alloc_device(4 * n)
    assert free0 - torch.cuda.mem_get_info()[0] >= 4 * n
    buf.zero(stream)
    out = np.full(n, 7.0, np.float32)
    buf.to_host(out.ctypes.data, out.nbytes, stream)
    assert not out.any()
    src = np.arange(n, dtype=np.float32)
    buf.from_host(src.ctypes.data, src.nbytes, stream)
    back = np.empty(n, np.float32)
    buf.to_host(back.ctypes.data, back.nbytes, stream)
    assert np.array_equal(back, src)
    with pytest.raises(ValueError, match="does not fit"):
        buf.to_host(back.ctypes.data, back.nbytes + 4, stream)
    before = torch.cuda.mem_get_info()[0]
    buf.free()
    buf.free()
    assert torch.cuda.mem_get_info()[0] - before >= 4 * n
    with pytest.raises(drv.CudaDriverError, match="after free"):
        buf.to_host(back.ctypes.data, 4, stream)
