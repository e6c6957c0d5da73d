"""Fakes of the device placement's backend for the CPU tests of its launches and ring (tests/test_device_launches.py,
tests/test_device_ring.py): pointers are plain ints, events ids."""

from __future__ import annotations

import itertools


class _Event:
    ids = itertools.count()

    def __init__(self):
        self.id = next(self.ids)

    def synchronize(self):
        pass


class _Backend:
    """Pointers are plain ints (``data_ptr`` returns the 'tensor' itself)."""

    device_index = 0

    def __init__(self):
        self.waits: list[int] = []

    def update_stream(self):
        return 0

    def update_wait(self, event):
        pass

    def record_update(self):
        return _Event()

    def record_compute(self, param):
        return None

    def data_ptr(self, tensor):
        return tensor

    def param_to_host_f32(self, param, out):
        out[:] = 0

    def wait_on_compute(self, event, param):
        self.waits.append(event.id)
