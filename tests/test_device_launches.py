"""How ``DevicePlacement.step`` groups its launches and keeps state resident in GPU memory, on CPU: the kernels'
launcher and the CUDA backend are replaced by recorders (no CuPy, no GPU); its staging ring: tests/test_device_ring.py.
What the launches compute is tested on the GPU (``tests/test_device_kernels.py``: a launch of many == launches of
one == the contract; ``tests/test_device_recipes_gpu.py``: bit-identity with torch's recipes on CUDA;
``tests/test_torch_gpu.py``: with ``torch.optim.AdamW`` through the adapter)."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from trainstream import contract as C
from trainstream import _device_kernels as dk
from trainstream import _device_recipes as R
from trainstream.core import _device as ge
from _device_fakes import _Backend

HP = C.AdamWHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0)


@pytest.fixture
def launches(monkeypatch):
    """Replace the launcher: record (param dtype, grad dtype, [n], [clip], max_blocks,
    [(master, m, v) pointers]) per launch; ``fail_at[0] = k`` makes the k-th launch raise."""
    record, fail_at = [], [None]
    buffers = {}
    addresses = itertools.count(1 << 20, 1 << 26)

    def alloc_mapped(nbytes, device=None):
        ptr = next(addresses)
        buffers[ptr] = np.zeros(nbytes, np.uint8)
        return ptr, ptr, lambda: None

    def multi(recipe, gd, items, stream=0, *, device=None, max_blocks=None):
        items = [R.TorchItem(*it) for it in items]
        record.append((recipe.dtype, gd, [it.n for it in items], [float(it.scalars[C.S_CLIP]) for it in items],
                       max_blocks, [(it.master, it.m, it.v) for it in items]))
        if fail_at[0] is not None and len(record) == fail_at[0]:
            raise RuntimeError("launch refused")
        return len(items)

    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "alloc_mapped", alloc_mapped)
    monkeypatch.setattr(dk, "host_view", lambda ptr, n, dtype=np.float32: buffers[ptr].view(dtype)[:n])
    monkeypatch.setattr(R, "launch_torch_multi", multi)
    return record, fail_at


def _engine(dtypes_sizes):
    eng = ge.DevicePlacement(_Backend())
    eng.staged = False  # the grouping of the launches; the ring has its own tests below
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
    eng.staged = False  # c's launch reads its mapped state (staged: see the ring's tests)
    a = eng.add_param(1000, 5, "float32", "cuda", gpu_state=True)
    b = eng.add_param(2000, 3, "bfloat16", "cuda", gpu_state=True)
    c = eng.add_param(3000, 4, "float32", "cuda")
    assert [eng.has_gpu_state(s) for s in (a, b, c)] == [True, True, False]
    assert [x.nbytes for x in allocs] == [20, 20, 12, 12, 12]  # m, v of a; m, v, master of b
    st = eng.stats()
    assert (st["gpu_state_bytes"], st["host_state_bytes"], st["gpu_state_params"], st["gpu_state_numel"]) == \
        (76, 32, 2, 8)
    sb = eng.state(b)
    assert sorted(sb) == ["exp_avg", "exp_avg_sq", "master", "step"]
    assert np.array_equal(sb["master"], weights[2000]) and not sb["exp_avg"].any() and not sb["exp_avg_sq"].any()
    assert sb["step"] == 0 and sorted(eng.state(a)) == ["exp_avg", "exp_avg_sq", "step"]  # fp32: no master
    eng.step([(a, HP, 5000, "float32"), (c, HP, 5064, "float32")])
    eng.step([(b, HP, 6000, "bfloat16")])
    ptrs = [p for r in record for p in r[5]]
    assert ptrs[0] == (0, allocs[0].dev_ptr, allocs[1].dev_ptr)
    assert ptrs[1][0] == 0 and ptrs[1][1] not in [x.dev_ptr for x in allocs]  # mapped
    assert ptrs[2] == (allocs[4].dev_ptr, allocs[2].dev_ptr, allocs[3].dev_ptr)
    assert [eng.get_step(s) for s in (a, b, c)] == [1, 1, 1]
    eng.load_state(a, {"exp_avg": np.full(5, 2.0), "exp_avg_sq": np.full((1, 5), 3.0), "step": 7})
    sa = eng.state(a)
    assert (sa["exp_avg"] == 2).all() and (sa["exp_avg_sq"] == 3).all() and sa["step"] == 7
    assert np.array_equal(allocs[0].data, sa["exp_avg"])
    kept = np.array([0.5001, -1.25, 3.0], np.float32)  # 0.5001 rounds to the bf16 weight 0.5
    eng.load_state(b, np.ones(3), np.ones(3), 2, kept)  # the positional form
    assert np.array_equal(allocs[4].data, kept)
    weights[2000] = np.array([0.5, 8.0, 3.0], np.float32)  # edited outside: element 1
    eng.reload_param(b)
    want = kept.copy()
    C.merge_master(want, weights[2000], "bfloat16")
    assert want[0] == kept[0] and want[1] == 8.0
    assert np.array_equal(allocs[4].data, want) and np.array_equal(eng.state(b)["master"], want)
    eng.load_state(b, {"exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3), "step": 0})  # no master: the weights
    assert np.array_equal(allocs[4].data, weights[2000])
    for bad, match in [({"exp_avg": np.zeros(3), "step": 0}, "takes"),
                       ({"exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(4), "step": 0}, "has 4 elements"),
                       ({"exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3), "step": -1}, "non-negative"),
                       ({"exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3), "step": 0,
                         "max_exp_avg_sq": np.zeros(3)}, "takes")]:
        with pytest.raises(ValueError, match=match):
            eng.load_state(b, bad)
    assert np.array_equal(allocs[4].data, weights[2000])  # nothing written by a refused load
    eng.truncate(1)
    assert [x.freed for x in allocs] == [False, False, True, True, True]
    st = eng.stats()
    assert (st["gpu_state_bytes"], st["host_state_bytes"], st["gpu_state_params"]) == (40, 0, 1)
    eng.close()
    assert all(x.freed for x in allocs)


def test_a_refused_gpu_allocation_frees_the_slots_others(launches, device_memory):
    allocs, fail = device_memory
    eng = ge.DevicePlacement(_Backend())
    fail[0] = 3  # the master of a bf16 slot
    with pytest.raises(MemoryError, match="GPU-resident state.*adamw.master_fp32.*12 bytes"):
        eng.add_param(1000, 3, "bfloat16", "cuda", gpu_state=True)
    assert len(allocs) == 2 and all(x.freed for x in allocs)
    assert eng.stats()["gpu_state_bytes"] == 0 and eng.stats()["params"] == 0
    with pytest.raises(ValueError, match="gpu_state_bytes needs CUDA parameters"):
        eng.add_param(1000, 3, "float32", "cpu", gpu_state=True)
    eng.close()


def test_a_slot_made_for_loaded_state_and_a_released_slot(launches, device_memory):
    """add_param(init=False) allocates a resident slot without writing it (no zeroing, no read
    of the weights): load_state writes moments and master. release() frees a slot's buffers
    (resident or mapped); its id stays taken and stats leave it out."""
    allocs, _ = device_memory
    backend = _Backend()
    reads = []
    backend.param_to_host_f32 = lambda param, out: reads.append(param) or out.__setitem__(slice(None), 7.0)
    eng = ge.DevicePlacement(backend)
    a = eng.add_param(1000, 4, "bfloat16", "cuda", gpu_state=True, init=False)
    b = eng.add_param(2000, 3, "float32", "cuda")  # mapped
    assert reads == [] and all(np.isnan(x.data).all() for x in allocs)  # m, v, master: unwritten
    eng.load_state(a, {"exp_avg": np.full(4, 2.0), "exp_avg_sq": np.full(4, 3.0), "step": 6,
                       "master": np.arange(4, dtype=np.float32)})
    st = eng.state(a)
    assert (st["exp_avg"] == 2).all() and (st["exp_avg_sq"] == 3).all() and st["step"] == 6
    assert np.array_equal(st["master"], np.arange(4))
    before = eng.stats()
    eng.release(a)
    assert all(x.freed for x in allocs)
    st = eng.stats()
    assert (st["params"], st["gpu_state_bytes"], st["gpu_state_params"]) == (1, 0, 0)
    assert st["host_state_bytes"] == before["host_state_bytes"] == 24
    eng.release(b)
    assert eng.stats()["params"] == 0 and eng.stats()["host_state_bytes"] == 0
    assert eng.add_param(3000, 2, "float32", "cuda") == 2  # the released ids stay taken
    eng.truncate(0)
    eng.close()
