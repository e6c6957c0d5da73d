"""How ``DevicePlacement.step`` groups its zero-copy launches, on CPU: the kernels' launcher and
the CUDA backend are replaced by recorders (no CuPy, no GPU). What the launches compute is
tested on the GPU (``tests/test_device_kernels.py``: a launch of many == launches of one ==
the contract; ``tests/test_torch_gpu.py``: bit-identity with ``torch.optim.AdamW``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _device_kernels as dk
from trainstream.core import _device as ge

HP = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0)


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


@pytest.fixture
def launches(monkeypatch):
    """Replace the launcher: record (param dtype, grad dtype, [n], [clip], max_blocks) per
    launch; ``fail_at[0] = k`` makes the k-th launch raise."""
    record, fail_at = [], [None]
    buffers = {}
    addresses = itertools.count(1 << 20, 1 << 26)

    def alloc_mapped(nbytes, device=None):
        ptr = next(addresses)
        buffers[ptr] = np.zeros(nbytes // 4, np.float32)
        return ptr, ptr, lambda: None

    def multi(variant, pd, gd, items, stream=0, *, device=None, max_blocks=None):
        items = list(items)
        record.append((pd, gd, [it[5] for it in items], [float(it[6][C.S_CLIP]) for it in items], max_blocks))
        if fail_at[0] is not None and len(record) == fail_at[0]:
            raise RuntimeError("launch refused")
        return len(items)

    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "alloc_mapped", alloc_mapped)
    monkeypatch.setattr(dk, "host_view", lambda ptr, n, dtype=np.float32: buffers[ptr][:n])
    monkeypatch.setattr(dk, "launch_adamw_multi", multi)
    return record, fail_at


def _engine(dtypes_sizes):
    eng = ge.DevicePlacement(_Backend())
    updates = []
    for k, (dtype, n) in enumerate(dtypes_sizes):
        sid = eng.add_param(1000 + 64 * k, n, dtype, "cuda")
        updates.append((sid, HP, 5000 + 64 * k, dtype))
    return eng, updates


def test_groups_close_at_a_dtype_change_the_element_cap_and_multi_max(launches):
    record, _ = launches
    cap = ge.MULTI_LAUNCH_ELEMS
    layout = ([("float32", 10), ("float32", 0), ("float32", cap - 10)]  # exactly the cap
              + [("bfloat16", 5), ("bfloat16", 7)]  # dtype change
              + [("float32", 100)] * 40  # 32 + 8
              + [("float32", cap + 1)]  # larger than the cap: alone
              + [("float32", 3)])
    eng, updates = _engine(layout)
    eng.step(updates)
    got = [(pd, ns) for pd, _, ns, *_ in record]
    assert got == [
        ("float32", [10, 0, cap - 10]),
        ("bfloat16", [5, 7]),
        ("float32", [100] * 32),
        ("float32", [100] * 8),
        ("float32", [cap + 1]),
        ("float32", [3]),
    ]
    # one step each, one ready event per launch, shared by its slots
    assert [eng.get_step(sid) for sid, *_ in updates] == [1] * len(updates)
    events = [eng._slot(sid).ready.id for sid, *_ in updates]
    assert len(set(events)) == 6 and events[0] == events[1] == events[2] != events[3]
    # the next forward waits once per launch, not once per slot
    eng.wait_ready([sid for sid, *_ in updates])
    assert eng.backend.waits == sorted(set(events))


def test_a_slot_listed_twice_goes_into_the_next_launch(launches):
    """Two updates of one slot in one launch would race on its state; the second one waits
    for a launch of its own (the stream orders it after the first)."""
    record, _ = launches
    eng, updates = _engine([("float32", 4), ("float32", 6)])
    eng.step([updates[0], updates[1], updates[0]])
    assert [ns for _, _, ns, *_ in record] == [[4, 6], [4]]
    assert eng.get_step(0) == 2 and eng.get_step(1) == 1


def test_a_failed_launch_leaves_the_later_slots_untouched(launches):
    record, fail_at = launches
    eng, updates = _engine([("float32", 100)] * 40)
    fail_at[0] = 2  # the second launch (slots 32-39) is refused
    with pytest.raises(RuntimeError, match="launch refused"):
        eng.step(updates)
    assert [eng.get_step(sid) for sid, *_ in updates] == [1] * 32 + [0] * 8
    assert all(eng._slot(sid).ready is None for sid in range(32, 40))


def test_eager_and_a_grid_cap_launch_one_tensor_each(launches):
    record, _ = launches
    eng, updates = _engine([("float32", 10), ("float32", 20)])
    eng.step(updates, eager=True)  # from a gradient hook: capped grid, one each
    assert [(r[2], r[4]) for r in record] == [([10], eng._eager_grid), ([20], eng._eager_grid)]
    record.clear()
    eng.step(updates, max_blocks=3)
    assert [(r[2], r[4]) for r in record] == [([10], 3), ([20], 3)]
    record.clear()
    eng.step(updates)
    assert [(r[2], r[3], r[4]) for r in record] == [([10, 20], [1.0, 1.0], None)]
