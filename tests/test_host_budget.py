"""Host memory as a budget (trainstream.core._budget, trainstream._hostmem.available): the
plan equals what the engine and the adapters allocate, pinned and pageable; a request
that does not fit raises MemoryError with the numbers before anything is allocated;
pinned moments fall back to pageable where pinning would pass the pinned budget."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trainstream import _device_kernels as dk
from trainstream import _hostmem
from trainstream import contract as C
from trainstream.core import _budget as B
from trainstream.core import _engine as E
from trainstream.core import _host
from trainstream.torch import OffloadAdamW
from trainstream.backends.torch import TorchBackend

_PART = {"adamw.exp_avg": "state", "adamw.exp_avg_sq": "state", "adamw.max_exp_avg_sq": "state",
         "adamw.master_fp32": "masters", "adamw.weights": "masters", "grad.staging": "staging",
         "param.staging": "staging", "grad.sum_fp32": "staging"}  # trainstream.core._budget's parts
_ITEM = {"float32": 4, "float16": 2, "bfloat16": 2}


def _avail(monkeypatch, nbytes):
    monkeypatch.setattr(_hostmem, "available", lambda *a, **k: nbytes)


# -- what is available ----------------------------------------------------------------------------


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_available_is_the_least_of_meminfo_and_the_cgroup_limits(tmp_path):
    proc, cg = str(tmp_path / "proc"), str(tmp_path / "cg")
    _write(f"{proc}/meminfo", "MemTotal: 4000 kB\nMemAvailable:    3000 kB\n")
    assert _hostmem.available(proc, cg) == 3000 * 1024  # no cgroup file: MemAvailable
    # v2: the group itself is unlimited, its parent's limit less usage (inactive file cache reclaimable)
    _write(f"{proc}/self/cgroup", "0::/a/b\n")
    _write(f"{cg}/a/b/memory.max", "max\n")
    _write(f"{cg}/a/memory.max", "2000000\n")
    _write(f"{cg}/a/memory.current", "1500000\n")
    _write(f"{cg}/a/memory.stat", "anon 1\ninactive_file 100000\nactive_file 5\n")
    assert _hostmem.available(proc, cg) == 600000
    # v1, in a container whose cgroup path is not under the mount: the mount's own group
    _write(f"{proc}/self/cgroup", "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n")
    _write(f"{cg}/memory/memory.limit_in_bytes", "800000\n")
    _write(f"{cg}/memory/memory.usage_in_bytes", "500000\n")
    _write(f"{cg}/memory/memory.stat", "cache 9\ntotal_inactive_file 20000\n")
    assert _hostmem.available(proc, cg) == 320000
    _write(f"{cg}/memory/memory.limit_in_bytes", str(2**63 - 4096))  # v1's "unlimited"
    assert _hostmem.available(proc, cg) == 3000 * 1024
    assert _hostmem.available(str(tmp_path / "none"), str(tmp_path / "none")) is None  # not Linux
    assert _hostmem.available() is None or _hostmem.available() > 0  # this host


def test_host_limit_parses_sizes_and_refuses_others(monkeypatch):
    monkeypatch.delenv(_hostmem.LIMIT_ENV, raising=False)
    assert _hostmem.host_limit() is None and _hostmem.host_limit("  ") is None
    sizes = (("1000", 1000), ("64G", 64 << 30), ("64gib", 64 << 30), ("1.5M", 3 << 19), (" 2 TiB ", 2 << 40))
    for text, nbytes in sizes:
        assert _hostmem.host_limit(text) == nbytes, text
    for bad in ("64GB", "0", "-1G", "abc", "1e9", "0.1"):
        with pytest.raises(ValueError, match=f"{_hostmem.LIMIT_ENV}=.*positive number of bytes"):
            _hostmem.host_limit(bad)


def test_available_within_the_limit_less_this_process_resident_memory(tmp_path, monkeypatch):
    proc = str(tmp_path / "proc")
    _write(f"{proc}/meminfo", "MemAvailable:    3000 kB\n")
    _write(f"{proc}/self/status", "Name: python\nVmHWM:  900 kB\nVmRSS:  1000 kB\n")
    monkeypatch.setenv(_hostmem.LIMIT_ENV, "2M")
    assert _hostmem.available(proc, str(tmp_path / "cg")) == (2048 - 1000) * 1024
    monkeypatch.setenv(_hostmem.LIMIT_ENV, "900K")  # less than the process holds already: nothing left
    assert _hostmem.available(proc, str(tmp_path / "cg")) == 0
    monkeypatch.setenv(_hostmem.LIMIT_ENV, "1T")  # above MemAvailable: that one
    assert _hostmem.available(proc, str(tmp_path / "cg")) == 3000 * 1024
    monkeypatch.setenv(_hostmem.LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match=_hostmem.LIMIT_ENV):
        _hostmem.available(proc, str(tmp_path / "cg"))


def test_torch_honours_the_host_limit(monkeypatch):
    """The limit is the budget's: a model whose state does not fit in it is refused before any allocation,
    naming the variable; a bad value is refused at construction."""
    model = _model(torch.bfloat16)
    need = OffloadAdamW.host_memory_plan(model.parameters(), host_margin=None)["needed"]
    assert _hostmem.resident() > 0  # this host's figure; a fixed one below (the process's moves as it allocates)
    monkeypatch.setattr(_hostmem, "resident", lambda proc="/proc": 1 << 30)
    monkeypatch.setenv(_hostmem.LIMIT_ENV, str(int((1 << 30) + need // 2)))
    with pytest.raises(MemoryError, match=f"{_hostmem.LIMIT_ENV} less its resident memory") as info:
        OffloadAdamW(model.parameters())
    assert f"{need // 2:,.0f} bytes" in str(info.value)
    assert OffloadAdamW.host_memory_plan(model.parameters())["fits"] == 0
    monkeypatch.setenv(_hostmem.LIMIT_ENV, str(int((1 << 30) + 2 * need)))
    OffloadAdamW(model.parameters()).close()
    monkeypatch.setenv(_hostmem.LIMIT_ENV, "64GB")
    with pytest.raises(ValueError, match=_hostmem.LIMIT_ENV):
        OffloadAdamW(model.parameters())


# -- the plan against the engine's allocations ------------------------------------------------------


class _Buf:
    def __init__(self, numel, dtype, pinned):
        self.array = np.zeros(numel, np.float32 if dtype == "float32" else np.uint16)
        self.pinned = pinned
        self.handle = None


class _Backend:
    """Records every host allocation; pins exactly the bytes asked (as TorchBackend on CUDA) or not."""

    device_index = 0

    def __init__(self, can_pin, weights_in_grad_stage):
        self.can_pin = can_pin
        self.weights_in_grad_stage = weights_in_grad_stage
        self.allocs = []  # (part, bytes taken, pinned)

    def host_empty(self, numel, dtype, *, pinned, what):
        pinned = pinned and self.can_pin
        nbytes = numel * _ITEM[dtype]
        self.allocs.append((_PART[what], nbytes, pinned))
        return _Buf(numel, dtype, pinned)

    def param_to_host_f32(self, param, out):
        out[:] = 0


@pytest.fixture
def mapped(monkeypatch):
    """The device placement's mapped memory, recorded (no CuPy, no GPU)."""
    sizes, buffers, addresses = [], {}, iter(range(1 << 20, 1 << 40, 1 << 30))

    def alloc_mapped(nbytes, device=None):
        ptr = next(addresses)
        sizes.append(nbytes)
        buffers[ptr] = np.zeros(nbytes // 4, np.float32)
        return ptr, ptr, lambda: None

    monkeypatch.setattr(dk, "compile_kernels", lambda device=None: {})
    monkeypatch.setattr(dk, "multiprocessor_count", lambda device=None: 132)
    monkeypatch.setattr(dk, "alloc_mapped", alloc_mapped)
    monkeypatch.setattr(dk, "host_view", lambda ptr, n, dtype=np.float32: buffers[ptr][:n])
    return sizes


_SLOTS = [(5000, "float32"), (3 << 12, "bfloat16"), (7000, "bfloat16"), (100, "float16"), (0, "float32"),
          (1 << 14, "float32"), (12345, "bfloat16")]


@pytest.mark.parametrize("placement", ["cpu", "hybrid"])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
@pytest.mark.parametrize("pin_moments", [False, True])
@pytest.mark.parametrize("backend", [(True, True), (True, False), (False, True)],
                         ids=["pinned", "separate-weight-staging", "cannot-pin"])
def test_plan_equals_what_the_engine_allocates(mapped, placement, chunk, pin_moments, backend):
    be = _Backend(*backend)
    budget = 20000
    eng = E.Engine(be, mode=placement, device_elems=budget, threads=1, chunk_size=chunk,
                   pin_moments=pin_moments)
    try:
        trainable = [k != 2 for k in range(len(_SLOTS))]  # a frozen one takes none of the GPU share
        dev = B.place([(n, t, None) for (n, _), t in zip(_SLOTS, trainable)], placement, budget)
        for (n, dtype), t in zip(_SLOTS, trainable):
            eng.add_param(np.zeros(n, np.float32), n, dtype, "cuda", trainable=t)
        assert [eng.on_device(s) for s in range(len(_SLOTS))] == dev
        assert (placement == "hybrid") == any(dev)
        plan = B.host_bytes([(n, d, "device" if g else "host") for (n, d), g in zip(_SLOTS, dev)],
                            pin_moments=pin_moments, can_pin=be.can_pin,
                            weights_in_grad_stage=be.weights_in_grad_stage)
        got = dict.fromkeys(plan, 0)
        for part, nbytes, pinned in be.allocs:
            got[f"{part}_{'pinned' if pinned else 'pageable'}"] += nbytes
        # the device share: moments (and fp16/bf16 masters) in mapped memory, in slot order
        it = iter(mapped)
        for (n, dtype), g in zip(_SLOTS, dev):
            if g:
                got["state_pinned"] += next(it) + next(it)
                if dtype != "float32":
                    got["masters_pinned"] += next(it)
        assert next(it, None) is None
        assert got == plan
        st = eng.stats()
        pinned = sum(v for k, v in plan.items() if k.endswith("_pinned"))
        assert st["pinned_state_bytes"] == pinned
        assert st["pageable_state_bytes"] == sum(plan.values()) - pinned
        assert st["host_state_bytes"] == sum(plan.values())
    finally:
        eng.close()



class _DeviceMemory:
    """A resident slot's GPU allocation (trainstream._cuda.DeviceMemory) over a NumPy array."""

    def __init__(self, nbytes, ptr):
        self.nbytes, self.dev_ptr, self.data = nbytes, ptr, np.zeros(nbytes // 4, np.float32)

    def zero(self, stream):
        self.data[:] = 0

    def from_host(self, host_ptr, nbytes, stream):
        pass

    def free(self):
        pass


@pytest.fixture
def gpu_memory(monkeypatch, mapped):
    """The GPU allocations of resident state, recorded (bytes each), beside ``mapped``."""
    sizes, addresses = [], iter(range(1 << 41, 1 << 50, 1 << 30))

    def alloc_device(nbytes, device=None):
        sizes.append(nbytes)
        return _DeviceMemory(nbytes, next(addresses))

    monkeypatch.setattr(dk, "alloc_device", alloc_device)
    monkeypatch.setattr(_Backend, "update_stream", lambda self: 0, raising=False)
    return sizes


# (numel, dtype, trainable): zero-size shards and frozen parameters among them
_MIXED = [(5000, "float32", True), (3 << 12, "bfloat16", True), (7000, "bfloat16", False), (100, "float16", True),
          (0, "float32", True), (1 << 14, "float32", True), (0, "bfloat16", True), (12345, "bfloat16", True),
          (64, "float16", False), (2000, "float16", True)]
_LATER = [(300, "bfloat16", True), (0, "float16", True), (4000, "float32", True), (50, "float32", False),
          (6000, "bfloat16", True), (10, "float16", True)]


def _host_allocs(be, mapped, slots, dev):
    """The engine's host allocations by plan key: ``be``'s, and the mapped memory of the
    device slots that are not resident (moments, fp16/bf16 master), in slot order."""
    got = {f"{p}_{k}": 0 for p in B.PARTS for k in ("pinned", "pageable")}
    for part, nbytes, pinned in be.allocs:
        got[f"{part}_{'pinned' if pinned else 'pageable'}"] += nbytes
    it = iter(mapped)
    for (_, dtype, _), d in zip(slots, dev):
        if d:
            got["state_pinned"] += next(it) + next(it)
            got["masters_pinned"] += next(it) if dtype != "float32" else 0
    assert next(it, None) is None
    return got


@pytest.mark.parametrize("dtypes", ["mixed", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("resident", ["none", "some", "all"])
@pytest.mark.parametrize("mode,order", [("cpu", "first"), ("gpu", "first"), ("hybrid", "first"), ("hybrid", "last")])
@pytest.mark.parametrize("pin_moments", [False, True])
def test_torch_plan_is_what_the_engine_places_and_allocates(gpu_memory, mapped, dtypes, resident, mode, order,
                                                            pin_moments):
    """OffloadAdamW's placement (``_budget.assign`` asked once per group and the host plan
    from its answer, as ``__init__`` and ``add_param_group`` do on CUDA parameters) against
    the engine that registers the same parameters where it was told: the slots resident in
    GPU memory, those on the device placement and the host bytes (pinned and pageable, per
    part) are those the plan predicted, for a first group and a group added later that finds
    part of both budgets taken. The engine's device placement is the real one over faked
    CUDA allocations."""
    from trainstream.torch._params import _facts, _plan, grad_sums

    def params(slots):
        return [torch.nn.Parameter(torch.zeros(n, dtype=getattr(torch, d if dtypes == "mixed" else dtypes)),
                                   requires_grad=t) for n, d, t in slots]

    first, later = params(_MIXED), params(_LATER)
    slots = [(p.numel(), str(p.dtype)[6:], p.requires_grad) for p in first + later]
    need = [B.state_bytes(n, d) for n, d, t in slots if t]
    budget_bytes = {"none": 0, "some": sum(need[:len(need) // 2]) - 1, "all": sum(need)}[resident]
    # __init__: hybrid's share is of the trainable elements that are not resident
    res = B.gpu_state_fits(_facts(first), budget_bytes)
    share = round(0.4 * sum(p.numel() for p, r in zip(first, res) if p.requires_grad and not r)) \
        if mode == "hybrid" else 0
    be = _Backend(True, TorchBackend.weights_in_grad_stage)
    eng = E.Engine(be, mode=mode, device_elems=share, gpu_state_bytes=budget_bytes, threads=1, chunk_size=4096,
                   pin_moments=pin_moments)
    cuda = torch.device("cuda")
    try:
        want = dict.fromkeys(_host_allocs(be, mapped, [], []), 0.0)
        placed, dev = [], []
        for group, last in ((first, order == "last"), (later, False)):  # add_param_group: by fit, in order
            res = B.gpu_state_fits(_facts(group), budget_bytes, eng.gpu_state_used)
            where = B.assign(_facts(group), mode, device_elems=share, device_used=eng.device_elems_used,
                             gpu_state_bytes=budget_bytes, gpu_state_used=eng.gpu_state_used, last=last)
            recipes = [C.default_recipe("cuda", str(p.dtype)[6:]) for p in group]  # the fp32-master scheme
            plan = _plan(group, where, recipes, pin_moments, None, cuda)
            on_gpu = [w == "device" for w in where]
            assert not any(r and g for r, g in zip(res, on_gpu))
            assert [w == "gpu_state" for w in where] == res
            for p, w, r in zip(group, where, recipes):  # as the adapter registers them (_params.Slots.add)
                eng.add_param(np.zeros(p.numel(), np.float32), p.numel(), str(p.dtype)[6:], "cuda",
                              trainable=p.requires_grad, where=w, recipe=r, grad_sums=grad_sums(p, r, w))
            n0 = len(placed)
            placed += group
            assert [eng.has_gpu_state(s) for s in range(n0, len(placed))] == res
            assert [eng.on_device(s) for s in range(n0, len(placed))] == [r or g for r, g in zip(res, on_gpu)]
            dev += [g for g in on_gpu]
            for k in want:
                want[k] += plan[k]
            assert _host_allocs(be, mapped, slots[:len(placed)], dev) == want
            st = eng.stats()
            assert st["host_state_bytes"] == sum(want.values())
            assert st["pinned_state_bytes"] == sum(v for k, v in want.items() if k.endswith("_pinned"))
            gpu_state_bytes = sum(B.state_bytes(n, d) for (n, d, _), s in zip(slots, range(len(placed)))
                                 if eng.has_gpu_state(s))
            assert st["gpu_state_bytes"] == sum(gpu_memory) == gpu_state_bytes == eng.gpu_state_used
            assert gpu_state_bytes <= budget_bytes
            assert eng.device_elems_used == sum(n for (n, _, _), g in zip(slots, dev) if g) or mode != "hybrid"
        n_res = sum(eng.has_gpu_state(s) for s in range(len(placed)))
        assert (n_res > 0) == (resident != "none")
        if resident == "all":  # every trainable parameter, of both groups
            assert [eng.has_gpu_state(s) for s in range(len(placed))] == [t for _, _, t in slots]
        if mode == "hybrid" and resident != "all":
            assert 0 < eng.device_elems_used <= share
    finally:
        eng.close()

def test_pinned_moments_fall_back_to_pageable_by_budget(monkeypatch):
    slots = [(1 << 20, "bfloat16", "host")] * 4  # per element: 8 B moments, 4 master, 2 staging
    kw = {"can_pin": True}
    n = 4 << 20
    _avail(monkeypatch, 30 * n)
    p = B.plan(slots, pin_moments=True, **kw)
    assert p["pin_moments"] == 1 and p["state_pinned"] == 8 * n and p["pinned"] == 10 * n and p["fits"]
    _avail(monkeypatch, 18 * n)  # 10 B pinned > half of it; 14 B in all < 90 % of it
    p = B.plan(slots, pin_moments=True, **kw)
    assert p["pin_moments"] == 0 and p["state_pinned"] == 0 and p["state_pageable"] == 8 * n
    assert p["pinned"] == 2 * n and p["needed"] == 14 * n and p["fits"]
    _avail(monkeypatch, 15 * n)  # not even pageable fits within the margin
    p = B.plan(slots, pin_moments=True, **kw)
    assert not p["fits"] and p["usable"] == int(15 * n * 0.9)
    with pytest.raises(MemoryError, match=f"needs {p['needed']:,.0f} bytes"):
        B.check(p, "something")
    assert B.plan(slots, margin=None)["fits"]  # no check
    _avail(monkeypatch, None)  # unknown: nothing checked
    assert B.plan(slots, pin_moments=True, **kw)["pin_moments"] == 1
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="host_margin"):
            B.plan([], margin=bad)


# -- torch ----------------------------------------------------------------------------------------


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 7)).to(dtype)


# host bytes per parameter: fp32 weights, moments, gradient staging; bf16 as torch keeps it (bf16 moments, weights,
# gradient staging); master_weights=True: fp32 master and moments, bf16 staging, fp32 gradient sums
@pytest.mark.parametrize("dtype,master,per_param", [(torch.float32, False, 16), (torch.bfloat16, False, 8),
                                                    (torch.bfloat16, True, 18)])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_torch_plan_equals_the_allocation_and_trains(dtype, master, per_param, chunk, monkeypatch):
    model = _model(dtype)
    plan = OffloadAdamW.host_memory_plan(model.parameters(), master_weights=master)
    monkeypatch.setattr(_host, "CHUNK_SIZE", chunk)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, master_weights=master)
    st = opt.stats()
    numel = sum(p.numel() for p in model.parameters())
    assert st["host_plan_needed"] == plan["needed"] == st["pageable_state_bytes"] == st["host_state_bytes"]
    assert plan["needed"] == numel * per_param and plan["pinned"] == 0  # CPU: nothing pinned
    assert st["host_plan_fits"] == 1 and st["host_plan_available"] > 0
    model(torch.randn(4, 64, dtype=dtype)).float().square().mean().backward()
    opt.step()
    # a group added later is checked and counted too
    extra = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    opt.add_param_group({"params": [extra]})
    assert opt.stats()["host_plan_needed"] == plan["needed"] + 1000 * per_param \
        == opt.stats()["host_state_bytes"]
    opt.close()


def test_torch_refuses_before_allocating(monkeypatch):
    model = _model(torch.bfloat16)
    plan = OffloadAdamW.host_memory_plan(model.parameters())
    calls = []
    monkeypatch.setattr(_hostmem, "empty", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(TorchBackend, "host_empty", lambda *a, **k: calls.append(a))
    _avail(monkeypatch, 100_000)
    with pytest.raises(MemoryError) as info:
        OffloadAdamW(model.parameters())
    msg = str(info.value)
    assert calls == []
    for figure in (plan["needed"], plan["state_pageable"], plan["masters_pageable"], plan["staging_pageable"],
                   100_000, 90_000):
        assert f"{figure:,.0f}" in msg, (figure, msg)
    assert re.search(r"None of it was allocated\. To fit: .*zero_stage=1.*mode='gpu'.*host_margin=None", msg)
    assert OffloadAdamW.host_memory_plan(model.parameters())["fits"] == 0
    assert OffloadAdamW.host_memory_plan(model.parameters(), host_margin=None)["fits"] == 1
    with pytest.raises(ValueError, match="host_margin"):
        OffloadAdamW(model.parameters(), host_margin=1.5)



def test_torch_refuses_bad_parameters_before_the_plan(monkeypatch):
    """A parameter that registration refuses raises its own error before the host memory
    is planned or anything allocated: CPU parameters with gpu_state_bytes or a GPU mode
    (ValueError, not the MemoryError of a plan that leaves the resident state out), and
    in a later group a float64 parameter (TypeError), leaving the optimizer as it was."""
    model = _model(torch.float32)
    calls = []
    monkeypatch.setattr(_hostmem, "empty", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(TorchBackend, "host_empty", lambda *a, **k: calls.append(a))
    _avail(monkeypatch, 1000)  # no plan fits
    for kw, what in (({"gpu_state_bytes": 4096}, "gpu_state_bytes=4096 keeps state in GPU memory and needs CUDA"),
                     ({"gpu_state_bytes": 1 << 30}, "gpu_state_bytes=1073741824 keeps state in GPU memory"),
                     ({"mode": "hybrid", "gpu_state_bytes": 4096}, "mode='hybrid' needs CUDA parameters"),
                     ({"mode": "gpu"}, "mode='gpu' needs CUDA parameters")):
        with pytest.raises(ValueError, match=what):
            OffloadAdamW(model.parameters(), **kw)
    assert calls == []
    monkeypatch.undo()
    opt = OffloadAdamW(list(model.parameters())[:2], threads=1)
    before = opt.stats()
    _avail(monkeypatch, 1000)
    with pytest.raises(TypeError, match=r"param group 1, parameter 1 \(shape \(3,\), torch.float64\) has dtype"):
        opt.add_param_group({"params": [list(model.parameters())[2], torch.nn.Parameter(torch.zeros(3).double())]})
    after = opt.stats()
    assert len(opt.param_groups) == 1 and len(opt._slots) == 2
    assert all(after[k] == before[k] for k in ("host_plan_needed", "host_state_bytes", "params"))
    opt.close()

def test_torch_margin_none_skips_the_check_and_a_late_group_is_refused_whole(monkeypatch):
    model = _model(torch.float32)
    _avail(monkeypatch, 1000)
    OffloadAdamW(model.parameters(), host_margin=None).close()  # allocates regardless
    monkeypatch.undo()
    opt = OffloadAdamW(list(model.parameters())[:2])
    before = opt.stats()
    _avail(monkeypatch, 1000)
    with pytest.raises(MemoryError, match=r"needs [0-9,]+ bytes .* of host memory"):
        opt.add_param_group({"params": list(model.parameters())[2:]})
    assert len(opt.param_groups) == 1 and opt.stats()["host_state_bytes"] == before["host_state_bytes"]
    opt.close()



def test_torch_a_group_refused_after_its_plan_leaves_the_plan_as_it_was(monkeypatch):
    """A later group whose registration fails after its plan passed (here: the host refuses
    the third buffer of its second parameter, after the first one's slot was built) is
    left out of ``host_plan_*`` and of the engine's byte counts: they stay equal, and the
    next group adds its own."""
    model = _model(torch.float32)
    w, b = list(model.parameters())[:2]
    opt = OffloadAdamW([w], threads=1)
    before = opt.stats()
    real, calls = TorchBackend.host_empty, []

    def fails_third(self, *a, **k):
        calls.append(a)
        if len(calls) == 4 + 3:  # fp32: master, moments, gradient staging
            raise MemoryError("no pages")
        return real(self, *a, **k)

    monkeypatch.setattr(TorchBackend, "host_empty", fails_third)
    with pytest.raises(MemoryError, match="no pages"):
        opt.add_param_group({"params": [b, torch.nn.Parameter(torch.zeros(100))]})
    monkeypatch.undo()
    st = opt.stats()
    for k in ("needed", "pinned", "pageable"):
        assert st[f"host_plan_{k}"] == before[f"host_plan_{k}"]
    assert st["host_plan_needed"] == st["host_state_bytes"] == before["host_state_bytes"]
    assert st["host_plan_pageable"] == st["pageable_state_bytes"] and st["params"] == 1
    opt.add_param_group({"params": [b]})
    st = opt.stats()
    assert st["host_plan_needed"] == st["host_state_bytes"] == before["host_state_bytes"] + 300 * 16
    opt.close()

def test_torch_hybrid_plan_follows_the_split():
    """hybrid's split by fit, in the order gpu_params says: the GPU share's state mapped,
    the host share's pageable (CPU parameters: the host share pins nothing; the optimizer
    itself needs CUDA parameters, see test_gpu_hybrid_plan_equals_the_engine_bytes)."""
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (2000, 2000, 300)]
    for order, on_gpu in (("first", [True, False, True]), ("last", [False, True, True])):
        plan = OffloadAdamW.host_memory_plan(params, mode="hybrid", gpu_share=0.56, gpu_params=order,
                                             master_weights=True)
        host = sum(p.numel() for p, g in zip(params, on_gpu) if not g)
        dev = 4300 - host
        assert plan["state_pageable"] == 8 * host and plan["masters_pageable"] == 4 * host  # host share
        assert plan["state_pinned"] == 8 * dev and plan["masters_pinned"] == 4 * dev  # mapped, GPU share
        # the host share's bf16 staging and fp32 gradient sums
        assert plan["staging_pageable"] == 6 * host and plan["needed"] == 18 * host + 12 * dev
    with pytest.raises(ValueError, match="mode"):
        OffloadAdamW.host_memory_plan(params, mode="tpu")
    # the constructor's checks of the placement arguments, not a plan of what it refuses
    for kw, err, what in (({"gpu_state_bytes": -5}, ValueError, "Invalid gpu_state_bytes"),
                          ({"gpu_state_bytes": 1.5}, ValueError, "Invalid gpu_state_bytes"),
                          ({"gpu_state_bytes": True}, ValueError, "Invalid gpu_state_bytes"),
                          ({"gpu_state_bytes": "half"}, ValueError, "Invalid gpu_state_bytes"),
                          ({"mode": "hybrid", "gpu_share": 2.0}, ValueError, "Invalid gpu_share"),
                          ({"mode": "hybrid", "gpu_params": "middle"}, ValueError, "Invalid gpu_params"),
                          ({"gpu_params": "last"}, ValueError, "applies to mode='hybrid' only"),
                          ({"gpu_state_bytes": "auto", "gpu_params": "middle"}, ValueError, "Invalid gpu_params"),
                          ({"gpu_state_bytes": "auto", "gpu_params": "last"}, ValueError, "applies to mode='hybrid'")):
        with pytest.raises(err, match=what):
            OffloadAdamW.host_memory_plan(params, **kw)
    # "auto": everything offloaded until the first step, so the plan of no GPU state
    def bytes_planned(plan):  # the host's free memory ("available", "usable") moves between two reads
        return {k: v for k, v in plan.items() if k not in ("available", "usable")}

    assert bytes_planned(OffloadAdamW.host_memory_plan(params, gpu_state_bytes="auto")) == bytes_planned(
        OffloadAdamW.host_memory_plan(params))


def test_torch_plan_leaves_out_the_state_resident_in_gpu_memory():
    """gpu_state_bytes (master_weights=True): the first parameters whose state fits (first fit, 12 bytes per
    bf16 element) take no host memory, and hybrid's share is of the rest."""
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (2000, 3000, 300)]
    whole = OffloadAdamW.host_memory_plan(params, master_weights=True)
    # 30,000 bytes hold the state of 2000 (24,000) and then 300 (3,600) elements, not 3000's.
    plan = OffloadAdamW.host_memory_plan(params, gpu_state_bytes=30_000, master_weights=True)
    assert B.gpu_state_fits([(p.numel(), "bfloat16", True) for p in params], 30_000) == [True, False, True]
    assert plan["needed"] == whole["needed"] * 3000 // 5300 == 18 * 3000
    hyb = OffloadAdamW.host_memory_plan(params, mode="hybrid", gpu_share=0.5, gpu_state_bytes=24_000,
                                        master_weights=True)
    # resident: the 2000; of the other 3300 elements a share of 1650: the 300 fit, 3000 not
    assert hyb["state_pinned"] == 8 * 300 and hyb["state_pageable"] == 8 * 3000


# -- JAX ------------------------------------------------------------------------------------------


def test_jax_plan_equals_the_state_and_refuses_before_allocating(monkeypatch):
    jnp = pytest.importorskip("jax.numpy")
    import jax

    from trainstream.jax import offload_adamw

    params = jax.device_put({"w": jnp.ones((300, 64), jnp.bfloat16), "b": jnp.zeros(300, jnp.float32),
                             "h": jnp.ones((7, 5), jnp.float16)}, jax.devices("cpu")[0])  # XLA:CPU, also beside a GPU
    tx = offload_adamw(1e-3)
    plan = tx.host_memory_plan(params)
    state = tx.init(params)
    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    assert plan["state_pageable"] == nbytes(state.mu) + nbytes(state.nu) == 4 * 300 * 64 + 8 * 300 + 4 * 35
    assert plan["masters_pageable"] == nbytes(state.master) == 0  # optax's state: fp16/bf16 moments, no master
    master = offload_adamw(1e-3, master_weights=True)
    assert master.host_memory_plan(params)["masters_pageable"] == nbytes(master.init(params).master) \
        == 4 * (300 * 64 + 35)
    assert plan["pinned"] == plan["staging_pageable"] == 0 and plan["fits"] == 1
    _avail(monkeypatch, 10_000)
    made = []
    monkeypatch.setattr(jnp, "zeros", lambda *a, **k: made.append(a))
    with pytest.raises(MemoryError, match=f"needs {plan['needed']:,.0f} bytes.*jax.distributed"):
        tx.init(params)
    assert made == []
    assert offload_adamw(1e-3, host_margin=None).host_memory_plan(params)["fits"] == 1
    with pytest.raises(ValueError, match="host_margin"):
        offload_adamw(1e-3, host_margin=-1)


def test_jax_plan_counts_this_process_shards():
    """Sharded and replicated leaves over 4 CPU devices: the state of each device's shards."""
    pytest.importorskip("jax")
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from trainstream.jax import offload_adamw
        mesh = jax.make_mesh((4,), ("x",))
        params = {"w": jax.device_put(jnp.ones((64, 8), jnp.bfloat16), NamedSharding(mesh, P("x"))),
                  "r": jax.device_put(jnp.ones(10, jnp.float32), NamedSharding(mesh, P()))}
        tx = offload_adamw(1e-3)
        plan = tx.host_memory_plan(params)
        state = tx.init(params)
        held = lambda t: sum(s.data.nbytes for x in jax.tree.leaves(t) for s in x.addressable_shards)
        assert plan["state_pageable"] == held(state.mu) + held(state.nu) == 4 * 64 * 8 + 8 * 4 * 10, plan
        assert plan["masters_pageable"] == held(state.master) == 0, plan
        print("ok")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# -- on a GPU: the pinned allocations --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_plan_equals_the_pinned_allocations(dtype, monkeypatch):
    """cpu mode on CUDA: the plan's pinned bytes are the bytes the backend pins (``cuMemHostAlloc``, exactly the
    size asked: torch's CachingHostAllocator, which rounds to powers of two, hands out nothing); with pin_moments and
    too little memory for pinned moments, they are pageable, and the plan and the allocations agree again."""
    import trainstream.backends.torch as TB
    pinned_now, init = [0], TB._Pinned.__init__

    def counting(self, drv, nbytes):
        init(self, drv, nbytes)
        pinned_now[0] += nbytes
    monkeypatch.setattr(TB._Pinned, "__init__", counting)

    def torch_active():
        torch.cuda.synchronize()
        return torch.cuda.host_memory_stats().get("active_bytes.current", 0)

    def opened(**kw):
        pinned_now[0], a0 = 0, torch_active()
        opt = OffloadAdamW(model.parameters(), **kw)
        assert torch_active() == a0  # nothing from torch's pinned allocator
        return opt, opt.stats()

    model = torch.nn.Sequential(torch.nn.Linear(512, 1000), torch.nn.Linear(1000, 300)).to("cuda", dtype)
    for pin in (False, True):
        opt, st = opened(pin_moments=pin)
        assert st["host_plan_pin_moments"] == pin
        assert pinned_now[0] == st["host_plan_pinned"] == st["pinned_state_bytes"] > 0
        assert st["host_plan_pageable"] == st["pageable_state_bytes"]
        opt.close()
        del opt
    pinned = OffloadAdamW.host_memory_plan(model.parameters(), pin_moments=True)["pinned"]
    needed = OffloadAdamW.host_memory_plan(model.parameters())["needed"]
    avail = int(max(needed / 0.85, pinned * 1.5))
    assert pinned > B.PINNED_FRACTION * avail
    _avail(monkeypatch, avail)
    opt, st = opened(pin_moments=True)
    assert st["host_plan_pin_moments"] == 0 and st["host_plan_state_pinned"] == 0
    assert pinned_now[0] == st["host_plan_pinned"] == st["pinned_state_bytes"]
    assert not opt._engine.host.pin_moments
    opt.close()


@pytest.mark.gpu
def test_gpu_hybrid_plan_equals_the_engine_bytes():
    pytest.importorskip("cupy")
    model = torch.nn.Sequential(torch.nn.Linear(512, 1000), torch.nn.Linear(1000, 300)).to("cuda", torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), mode="hybrid", gpu_share=0.5)
    st = opt.stats()
    assert st["gpu_params"] > 0
    assert st["host_plan_pinned"] == st["pinned_state_bytes"] and st["host_plan_needed"] == st["host_state_bytes"]
    opt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("resident", ["none", "some", "all"])
@pytest.mark.parametrize("mode,order", [("cpu", "first"), ("gpu", "first"), ("hybrid", "first"), ("hybrid", "last")])
def test_gpu_plan_with_resident_state_equals_the_engine(mode, order, resident, dtype):
    """OffloadAdamW on CUDA: host_memory_plan() = host_plan_* = the engine's host bytes
    (pinned and pageable), the slots resident in GPU memory are the plan's, for a later
    group too."""
    pytest.importorskip("cupy")
    from trainstream.torch._params import _facts
    from trainstream.torch._recipe import recipe

    def facts(ps):  # the default recipe's state (fp16/bf16 moments for fp16/bf16 weights) sizes the resident slots
        return _facts(ps, [recipe({}, p, "single", False) for p in ps])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).to("cuda", dtype)
    model[1].bias.requires_grad_(False)
    extra = [torch.nn.Parameter(torch.zeros(n, device="cuda", dtype=dtype)) for n in (3000, 10)]
    params = list(model.parameters())
    need = [B.state_bytes(n, d, r) for n, d, t, r in facts(params + extra) if t]
    budget = {"none": 0, "some": need[1] + need[3] + need[4], "all": sum(need)}[resident]
    kw = {"mode": mode, "gpu_params": order, "gpu_share": 0.4, "gpu_state_bytes": budget}
    plan = OffloadAdamW.host_memory_plan(params, **kw)
    opt = OffloadAdamW(params, lr=1e-2, threads=1, **kw)
    try:
        st = opt.stats()
        assert st["host_plan_needed"] == plan["needed"] == st["host_state_bytes"]
        assert st["host_plan_pinned"] == plan["pinned"] == st["pinned_state_bytes"]
        want = B.gpu_state_fits(facts(params), budget)
        assert [opt._engine.has_gpu_state(s) for s in range(len(params))] == want and (resident == "none") != any(want)
        later = B.gpu_state_fits(facts(extra), budget, opt._engine.gpu_state_used)
        opt.add_param_group({"params": extra})
        st = opt.stats()
        assert st["host_plan_needed"] == st["host_state_bytes"] and st["host_plan_pinned"] == st["pinned_state_bytes"]
        assert [opt._engine.has_gpu_state(s) for s in range(len(params), len(params) + 2)] == later
        assert st["gpu_state_bytes"] == sum(B.state_bytes(n, d, rec) for (n, d, _, rec), r
                                            in zip(facts(params + extra), want + later) if r)
        x = torch.randn(8, 256, device="cuda", dtype=dtype)
        (model(x).float().square().mean() + sum(p.float().sum() for p in extra)).backward()
        opt.step()
        opt.synchronize()
    finally:
        opt.close()
