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
def test_mapped_memory_and_stream_memory_operations():
    """alloc_mapped gives host memory the device reads and writes; a stream waiting on a
    32-bit flag runs its later work only once another stream (or the host) has set it."""
    torch = pytest.importorskip("torch")
    dev = torch.device("cuda", torch.cuda.current_device())
    ctx = drv.context(dev.index)
    assert drv.context(dev.index) is ctx
    with pytest.raises(MemoryError, match=rf"could not allocate {2**60} bytes"):
        ctx.alloc_mapped(2**60)
    flag = ctx.alloc_mapped(4)
    word = (ctypes.c_uint32).from_address(flag.host_ptr)
    word.value = 0
    assert ctx.stream_memops, "the H200's driver supports stream memory operations"
    waiter, setter = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, device=dev)
    ctx.stream_wait_value32(waiter.cuda_stream, flag.dev_ptr, 2)
    with torch.cuda.stream(waiter):
        x += 1  # must not run before the flag reaches 2
    with torch.cuda.stream(setter):
        torch.cuda._sleep(1 << 26)
    ctx.stream_write_value32(setter.cuda_stream, flag.dev_ptr, 1)  # not enough
    assert not waiter.query()
    ctx.stream_write_value32(setter.cuda_stream, flag.dev_ptr, 2)
    waiter.synchronize()
    assert word.value == 2 and float(x.sum()) == x.numel()
    # released by a plain host store (the engine's failure path)
    ctx.stream_wait_value32(waiter.cuda_stream, flag.dev_ptr, 3)
    with torch.cuda.stream(waiter):
        x += 1
    assert not waiter.query()
    word.value = 3
    waiter.synchronize()
    assert float(x.sum()) == 2 * x.numel()
    del word
    flag.free()
    flag.free()  # idempotent
