"""The ctypes CUDA driver layer on a machine without one (CI): clear failures, no crash."""

import ctypes

import pytest

from trainstream.backends import _cuda_driver as drv


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
