"""How ``DevicePlacement.step`` groups its zero-copy launches, on CPU: the kernels' launcher and
the CUDA backend are replaced by recorders (no CuPy, no GPU). What the launches compute is
tested on the GPU (``tests/test_device_kernels.py``: a launch of many == launches of one ==
the contract; ``tests/test_torch_gpu.py``: bit-identity with ``torch.optim.AdamW``)."""

from __future__ import annotations

import ctypes
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
    """Replace the launcher: record (param dtype, grad dtype, [n], [clip], max_blocks,
    [(master, m, v) pointers]) per launch; ``fail_at[0] = k`` makes the k-th launch raise."""
    record, fail_at = [], [None]
    buffers = {}
    addresses = itertools.count(1 << 20, 1 << 26)

    def alloc_mapped(nbytes, device=None):
        ptr = next(addresses)
        buffers[ptr] = np.zeros(nbytes // 4, np.float32)
        return ptr, ptr, lambda: None

    def multi(variant, pd, gd, items, stream=0, *, device=None, max_blocks=None):
        items = list(items)
        record.append((pd, gd, [it[5] for it in items], [float(it[6][C.S_CLIP]) for it in items], max_blocks,
                       [tuple(it[2:5]) for it in items]))
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


# -- state resident in GPU memory ----------------------------------------------------------------


class _DeviceMemory:
    """trainstream._cuda.DeviceMemory over a NumPy array (NaN until written)."""

    addresses = itertools.count(1 << 40, 1 << 26)

    def __init__(self, nbytes):
        self.nbytes, self.dev_ptr, self.freed = nbytes, next(self.addresses), False
        self.data = np.full(nbytes // 4, np.nan, np.float32)

    def to_host(self, host_ptr, nbytes, stream):
        assert stream == 0 and not self.freed and nbytes <= self.nbytes  # on the update stream
        ctypes.memmove(host_ptr, self.data.ctypes.data, nbytes)

    def from_host(self, host_ptr, nbytes, stream):
        assert stream == 0 and not self.freed and nbytes <= self.nbytes
        ctypes.memmove(self.data.ctypes.data, host_ptr, nbytes)

    def zero(self, stream):
        self.data[:] = 0

    def free(self):
        self.freed = True


@pytest.fixture
def device_memory(monkeypatch, launches):
    """Replace GPU allocations: the list of them; ``fail[0] = k`` refuses the k-th."""
    allocs, fail = [], [None]

    def alloc_device(nbytes, device=None):
        if fail[0] is not None and len(allocs) + 1 == fail[0]:
            raise MemoryError(f"could not allocate {nbytes} bytes of GPU memory")
        allocs.append(_DeviceMemory(nbytes))
        return allocs[-1]

    monkeypatch.setattr(dk, "alloc_device", alloc_device)
    return allocs, fail


def test_resident_slots_keep_their_state_in_device_memory(launches, device_memory):
    """A resident slot's moments (and master) are GPU allocations that the launches address
    instead of mapped memory; its state I/O copies through them: zeroed moments and the
    weights as master at the start, state() and load_state() (with or without a master),
    reload_param() merging the master with edited weights; stats count them apart;
    truncate() and close() free them."""
    record, _ = launches
    allocs, _ = device_memory
    weights = {1000: np.arange(5, dtype=np.float32), 2000: np.array([0.5, -1.25, 3.0], np.float32),
               3000: np.ones(4, np.float32)}
    backend = _Backend()
    backend.param_to_host_f32 = lambda param, out: out.__setitem__(slice(None), weights[param])
    eng = ge.DevicePlacement(backend)
    a = eng.add_param(1000, 5, "float32", "cuda", resident=True)
    b = eng.add_param(2000, 3, "bfloat16", "cuda", resident=True)
    c = eng.add_param(3000, 4, "float32", "cuda")
    assert [eng.resident(s) for s in (a, b, c)] == [True, True, False]
    assert [x.nbytes for x in allocs] == [20, 20, 12, 12, 12]  # m, v of a; m, v, master of b
    st = eng.stats()
    assert (st["gpu_state_bytes"], st["host_state_bytes"], st["resident_params"], st["resident_numel"]) == \
        (76, 32, 2, 8)
    master, m, v, step = eng.state(b)
    assert np.array_equal(master, weights[2000]) and not m.any() and not v.any() and step == 0
    assert np.array_equal(eng.state(a)[0], weights[1000])  # fp32: the weights are the master
    eng.step([(a, HP, 5000, "float32"), (c, HP, 5064, "float32")])
    eng.step([(b, HP, 6000, "bfloat16")])
    ptrs = [p for r in record for p in r[5]]
    assert ptrs[0] == (0, allocs[0].dev_ptr, allocs[1].dev_ptr)
    assert ptrs[1][0] == 0 and ptrs[1][1] not in [x.dev_ptr for x in allocs]  # mapped
    assert ptrs[2] == (allocs[4].dev_ptr, allocs[2].dev_ptr, allocs[3].dev_ptr)
    assert [eng.get_step(s) for s in (a, b, c)] == [1, 1, 1]
    eng.load_state(a, np.full(5, 2.0), np.full((1, 5), 3.0), 7)
    master, m, v, step = eng.state(a)
    assert (m == 2).all() and (v == 3).all() and step == 7 and np.array_equal(allocs[0].data, m)
    kept = np.array([0.5001, -1.25, 3.0], np.float32)  # 0.5001 rounds to the bf16 weight 0.5
    eng.load_state(b, np.ones(3), np.ones(3), 2, master=kept)
    assert np.array_equal(allocs[4].data, kept)
    weights[2000] = np.array([0.5, 8.0, 3.0], np.float32)  # edited outside: element 1
    eng.reload_param(b)
    want = kept.copy()
    C.merge_master(want, weights[2000], "bfloat16")
    assert want[0] == kept[0] and want[1] == 8.0
    assert np.array_equal(allocs[4].data, want) and np.array_equal(eng.state(b)[0], want)
    eng.load_state(b, np.zeros(3), np.zeros(3), 0)  # no master: re-read from the weights
    assert np.array_equal(allocs[4].data, weights[2000])
    with pytest.raises(ValueError, match="exp_avg of parameter slot 0 has 4 elements, expected 5"):
        eng.load_state(a, np.zeros(4), np.zeros(5), 0)
    eng.truncate(1)
    assert [x.freed for x in allocs] == [False, False, True, True, True]
    st = eng.stats()
    assert (st["gpu_state_bytes"], st["host_state_bytes"], st["resident_params"]) == (40, 0, 1)
    eng.close()
    assert all(x.freed for x in allocs)


def test_a_refused_gpu_allocation_frees_the_slots_others(launches, device_memory):
    allocs, fail = device_memory
    eng = ge.DevicePlacement(_Backend())
    fail[0] = 3  # the master of a bf16 slot
    with pytest.raises(MemoryError, match="GPU-resident state.*adamw.master_fp32.*12 bytes"):
        eng.add_param(1000, 3, "bfloat16", "cuda", resident=True)
    assert len(allocs) == 2 and all(x.freed for x in allocs)
    assert eng.stats()["gpu_state_bytes"] == 0 and eng.stats()["params"] == 0
    with pytest.raises(ValueError, match="gpu_state_bytes needs CUDA parameters"):
        eng.add_param(1000, 3, "float32", "cpu", resident=True)
    eng.close()
