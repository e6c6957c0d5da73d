"""The engine's ``hybrid`` placement policy on CPU: a host placement stands in for the
device one (adapted to the zero-copy placement's step signature); slots are placed by
elements in registration order, work and state go to the right placement, and the result
equals one host placement doing everything. The same for the GPU-resident share
(``gpu_state_bytes``) in every mode."""

import numpy as np
import pytest

from trainstream import contract as C
from trainstream.core import _engine as E
from trainstream.core import _host as H


class _Buf:
    def __init__(self, numel, dtype):
        self.array = np.zeros(numel, np.float32 if dtype == "float32" else np.uint16)
        self.pinned = False
        self.handle = None


class Backend:
    """Host-only backend: parameters are NumPy float32 arrays."""

    def host_empty(self, numel, dtype, *, pinned, what):
        return _Buf(numel, dtype)

    def param_to_host_f32(self, param, out):
        out[:] = param

    def record_compute(self, param):
        return None

    def copy_to_host(self, dst, src, after):
        dst.array[:] = src
        return None

    def copy_to_device(self, dst, src, after):
        dst[:] = src.array
        return None

    def wait_on_compute(self, event, param):
        pass


class FakeDevice:
    """The zero-copy placement's interface over a host placement (step takes the gradients)."""

    def __init__(self):
        self.e = H.HostPlacement(Backend(), threads=1, chunk_size=4096)
        self.eager_calls = 0
        self.resident: list[int] = []  # local ids of the slots added resident

    def __getattr__(self, name):
        return getattr(self.e, name)

    def add_param(self, param, numel, dtype, platform, *, gpu_state=False, init=True):
        sid = self.e.add_param(param, numel, dtype, platform)
        if gpu_state:
            self.resident.append(sid)
        return sid

    def truncate(self, n):
        self.resident = [sid for sid in self.resident if sid < n]
        self.e.truncate(n)

    def state(self, sid, copy=True):  # the device placement's: the state dict (a master for fp16/bf16 weights)
        return self.e.state(sid, copy)

    def load_state(self, sid, state):  # without a master: the weights' (float32: the weights themselves)
        self.e.load_state(sid, state)

    def stats(self):
        slots = [self.e._slot(sid) for sid in self.resident]
        return {**self.e.stats(), "gpu_state_params": float(len(slots)),
                "gpu_state_numel": float(sum(s.numel for s in slots)),
                "gpu_state_bytes": float(sum(E.state_bytes(s.numel, s.dtype) for s in slots)),
                "staging_ring_bytes": 0.0}

    def check_grads(self, updates):
        for sid, _, _, gdtype in updates:
            if gdtype not in ("float32", "float16", "bfloat16"):
                raise TypeError(f"gradient of parameter slot {sid} has unsupported dtype {gdtype}")

    def _offload(self, updates):
        for sid, hp, grad, gdtype in updates:
            if not self.e.has_grad(sid):
                self.e.offload_grad(sid, grad, gdtype)

    def step(self, updates, *, eager=False, max_blocks=None, grad_div=None):
        self.eager_calls += eager
        self._offload(updates)
        self.e.step([(sid, hp) for sid, hp, _, _ in updates])


def _same_state(a, b):
    """Two slots' state dicts hold the same keys and bits."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for n in (5000, 3000, 7000, 100)]


def test_split_equals_one_engine_and_dispatches_by_registration_order():
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    whole_p, split_p = _params(), _params()
    whole = H.HostPlacement(Backend(), threads=2, chunk_size=4096)
    split = E.Engine(Backend(), mode="hybrid", device_elems=6000, threads=2, chunk_size=4096,
                     _device=FakeDevice)
    for p in whole_p:
        whole.add_param(p, p.size, "float32", "cpu")
    for p in split_p:
        split.add_param(p, p.size, "float32", "cpu")
    assert [split.on_device(s) for s in range(4)] == [True, False, False, True]  # what fits in 6000
    rng = np.random.default_rng(1)
    for _ in range(5):
        grads = [rng.standard_normal(p.size).astype(np.float32) for p in whole_p]
        for sid, g in enumerate(grads):
            whole.offload_grad(sid, g, "float32")
        whole.step([(sid, hp) for sid in range(4)])
        cpu_updates = []
        for sid, g in enumerate(grads):
            if not split.on_device(sid):
                split.offload_grad(sid, g, "float32")
                cpu_updates.append((sid, hp))
        split.step(cpu_updates + [(sid, hp, grads[sid], "float32") for sid in range(4) if split.on_device(sid)])
        whole.synchronize()
        split.synchronize()
    for a, b in zip(whole_p, split_p):
        assert np.array_equal(a, b)
    for sid in range(4):
        assert _same_state(whole.state(sid), split.state(sid))
        assert split.get_step(sid) == 5
    st = split.stats()
    assert st["params"] == 4 and st["gpu_params"] == 2 and st["numel"] == 15100
    assert split.add_param(np.zeros(10, np.float32), 10, "float32", "cpu", trainable=False) == 4
    assert not split.on_device(4)
    with pytest.raises(RuntimeError, match="updated on the device, not on the host"):
        split.offload_grad(0, np.zeros(5000, np.float32), "float32")
    split.truncate(3)  # drops slot 3 (GPU share, 100 elements) and 4: the share is free again
    assert split.add_param(np.zeros(10, np.float32), 10, "float32", "cpu") == 3
    assert split.on_device(3)
    whole.close()
    split.close()


def test_explicit_placement_and_eager_gpu_share():
    """``gpu_params="last"``'s placement (the adapter says which slots go to the GPU) and
    its eager path: the GPU share launched slot by slot during backward, the host share at
    ``step()`` without them; the bits of one engine doing everything."""
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    whole_p, split_p = _params(), _params()
    whole = H.HostPlacement(Backend(), threads=2, chunk_size=4096)
    gpu = FakeDevice()
    split = E.Engine(Backend(), mode="hybrid", device_elems=7100, threads=2, chunk_size=4096,
                     _device=lambda: gpu)
    for p in whole_p:
        whole.add_param(p, p.size, "float32", "cpu")
    for sid, p in enumerate(split_p):
        split.add_param(p, p.size, "float32", "cpu", on_device=sid >= 2)
    assert [split.on_device(s) for s in range(4)] == [False, False, True, True]
    assert split.add_param(np.zeros(10, np.float32), 10, "float32", "cpu", trainable=False, on_device=True) == 4
    assert not split.on_device(4)  # a frozen parameter stays on the host whatever gpu says
    split.truncate(4)
    rng = np.random.default_rng(2)
    for _ in range(4):
        grads = [rng.standard_normal(p.size).astype(np.float32) for p in whole_p]
        for sid, g in enumerate(grads):
            whole.offload_grad(sid, g, "float32")
        whole.step([(sid, hp) for sid in range(4)])
        for sid in (3, 2):  # backward's order: the last parameters' gradients first
            split.launch_eager([(sid, hp, grads[sid], "float32")])
        for sid in (1, 0):
            split.offload_grad(sid, grads[sid], "float32")
        split.step([(0, hp), (1, hp)])
        whole.synchronize()
        split.synchronize()
    assert gpu.eager_calls == 8
    for a, b in zip(whole_p, split_p):
        assert np.array_equal(a, b)
    assert [split.get_step(s) for s in range(4)] == [4] * 4
    whole.close()
    split.close()


def test_split_takes_a_multiplier_per_host_slot():
    """The torch adapter clips (and unscales) param.grad with torch's own operations and
    gives the host slots the same multiplier of their staged copies (``coefs``): the bits
    of one host engine stepping with that coefficient."""
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    whole_p, split_p = _params(), _params()
    whole = H.HostPlacement(Backend(), threads=2, chunk_size=4096)
    split = E.Engine(Backend(), mode="hybrid", device_elems=6000, threads=3, chunk_size=2048,
                     _device=FakeDevice)
    for p in whole_p:
        whole.add_param(p, p.size, "float32", "cpu")
    for p in split_p:
        split.add_param(p, p.size, "float32", "cpu")
    host = [sid for sid in range(4) if not split.on_device(sid)]
    assert host and len(host) < 4
    rng = np.random.default_rng(2)
    for t in range(4):
        grads = [rng.standard_normal(p.size).astype(np.float32) * 0.02 for p in whole_p]
        coef = np.float32(0.25 + 0.125 * t)
        for sid in host:
            split.offload_grad(sid, grads[sid], "float32")
            whole.offload_grad(sid, grads[sid], "float32")
        split.step([(sid, hp) for sid in host] + [(sid, hp, grads[sid] * coef, "float32")
                                                  for sid in range(4) if split.on_device(sid)],
                   coefs={sid: coef for sid in host})
        whole.step([(sid, hp) for sid in host], coefs={sid: coef for sid in host})
        whole.synchronize()
        split.synchronize()
    for sid in host:
        assert np.array_equal(whole_p[sid], split_p[sid])
    whole.close()
    split.close()


def test_split_worker_error_after_its_check_steps_both_shares_and_raises_later():
    """A worker error recorded between the engine's own check and the host share's step is
    not raised there (the GPU share is already queued): both shares step, and the error
    comes out at the next call."""
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    params = _params()
    gpu = FakeDevice()
    split = E.Engine(Backend(), mode="hybrid", device_elems=6000, threads=1, chunk_size=4096,
                     _device=lambda: gpu)
    for p in params:
        split.add_param(p, p.size, "float32", "cpu")
    grads = [np.ones(p.size, np.float32) for p in params]
    for sid in range(4):
        if not split.on_device(sid):
            split.offload_grad(sid, grads[sid], "float32")
    real_step = gpu.step

    def step_then_worker_error(*a, **k):  # an error lands while the GPU share is queued
        real_step(*a, **k)
        split.errors.record(RuntimeError("worker failed"))

    gpu.step = step_then_worker_error
    split.step([(sid, hp) for sid in range(4) if not split.on_device(sid)]
               + [(sid, hp, grads[sid], "float32") for sid in range(4) if split.on_device(sid)])
    assert [split.get_step(sid) for sid in range(4)] == [1, 1, 1, 1]
    with pytest.raises(E.WorkerError, match="worker failed"):
        split.synchronize()
    split.clear_error()
    split.close()


def test_hybrid_mode_argument_checks():
    torch = pytest.importorskip("torch")
    from trainstream.torch import OffloadAdamW

    model = torch.nn.Linear(4, 4)
    for params in (model.parameters(), model.named_parameters(), [{"params": model.parameters()}]):
        with pytest.raises(ValueError, match="mode='hybrid' needs CUDA parameters"):
            OffloadAdamW(params, mode="hybrid")
    with pytest.raises(ValueError, match="mode='hybrid' needs CUDA parameters"):
        OffloadAdamW(model.parameters(), mode="hybrid", max_grad_norm=1.0)
    for bad in (True, 1.5, -0.1, "half"):
        with pytest.raises(ValueError, match="gpu_share"):
            OffloadAdamW(model.parameters(), mode="hybrid", gpu_share=bad)
    with pytest.raises(ValueError, match="needs CUDA"):
        OffloadAdamW(model.parameters(), mode="hybrid", gpu_share=np.float32(0.3))
    for bad in ("middle", None, 1):
        with pytest.raises(ValueError, match="Invalid gpu_params"):
            OffloadAdamW(model.parameters(), mode="hybrid", gpu_params=bad)
    for mode in ("cpu", "gpu"):
        with pytest.raises(ValueError, match="applies to mode='hybrid' only"):
            OffloadAdamW(model.parameters(), mode=mode, gpu_params="last")
    with pytest.raises(ValueError, match="needs CUDA"):
        OffloadAdamW(model.parameters(), mode="hybrid", gpu_params="last")


def _order_split(gpu_elems, skip_grads=(), **kw):
    """Four slots (5000, 3000, 7000, 100 elements); the order in which step() queues the
    two shares, recorded around the real calls."""
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    params = _params()
    split = E.Engine(Backend(), mode="hybrid", device_elems=gpu_elems, threads=1, chunk_size=4096,
                     _device=FakeDevice)
    for p in params:
        split.add_param(p, p.size, "float32", "cpu", **kw)
    order = []
    for name, engine in (("host", split.host), ("gpu", split.device)):
        real = engine.step

        def recorded(*a, _real=real, _name=name, **k):
            order.append(_name)
            return _real(*a, **k)

        engine.step = recorded
    grads = [np.ones(p.size, np.float32) for p in params]
    for sid in range(4):
        if not split.on_device(sid) and sid not in skip_grads:
            split.offload_grad(sid, grads[sid], "float32")
    cpu_updates = [(sid, hp) for sid in range(4) if not split.on_device(sid)]
    gpu_updates = [(sid, hp, grads[sid], "float32") for sid in range(4) if split.on_device(sid)]
    return split, order, cpu_updates, gpu_updates


def test_a_host_slot_without_gradient_does_not_put_the_host_share_first():
    """3500: slot 0 is on the host but takes no gradient this step (frozen, unused):
    the first slot updated is the GPU share's slot 1, so the GPU share goes first."""
    split, order, cpu_updates, gpu_updates = _order_split(3500, skip_grads=(0,))
    split.step(cpu_updates + gpu_updates)
    split.synchronize()
    assert order == ["gpu", "host"]
    assert [split.get_step(sid) for sid in range(4)] == [0, 1, 1, 1]
    split.close()


def test_gpu_share_failing_after_the_host_share_is_sticky():
    """Host share first, then the GPU share's launch fails: the call raises it, and every
    later call raises a sticky error until the state is reloaded (the host share has
    taken the step, the GPU share has not)."""
    split, order, cpu_updates, gpu_updates = _order_split(3500)

    def launch_fails(*a, **k):
        order.append("gpu")
        raise RuntimeError("launch failed")

    split.device.step = launch_fails
    with pytest.raises(RuntimeError, match="launch failed"):
        split.step(cpu_updates + gpu_updates)
    assert order == ["host", "gpu"]
    with pytest.raises(E.WorkerError, match="device share's update failed after the host share's was queued"):
        split.synchronize()
    split.clear_error()
    split.close()


@pytest.mark.parametrize("gpu_elems,first", [(6000, "gpu"), (3500, "host")])
def test_the_share_holding_the_first_slot_is_queued_first(gpu_elems, first):
    """6000: slots 0 and 3 on the GPU share, which goes first; 3500: slot 0 (5000) does
    not fit, so the host share holds it and goes first (the 125M case: the tied
    embedding on the host)."""
    split, order, cpu_updates, gpu_updates = _order_split(gpu_elems)
    split.step(cpu_updates + gpu_updates)
    split.synchronize()
    assert order == ([first, "host" if first == "gpu" else "gpu"])
    assert [split.get_step(sid) for sid in range(4)] == [1, 1, 1, 1]
    split.close()


def test_a_bad_gpu_share_gradient_queues_neither_share():
    """With the host share first, a GPU-share gradient the kernels cannot take still
    raises before anything is queued: no slot's step advances."""
    split, order, cpu_updates, gpu_updates = _order_split(3500)
    bad = [(sid, hp, g, "float64") for sid, hp, g, _ in gpu_updates]
    with pytest.raises(TypeError, match="unsupported dtype float64"):
        split.step(cpu_updates + bad)
    assert order == [] and [split.get_step(sid) for sid in range(4)] == [0, 0, 0, 0]
    split.close()


# -- the GPU-resident share (gpu_state_bytes) ------------------------------------------------------


def test_state_bytes():
    assert E.state_bytes(100, "float32") == 800
    assert E.state_bytes(100, "bfloat16") == E.state_bytes(100, "float16") == 1200
    assert E.state_bytes(0, "float32") == 8  # an empty shard: 4 bytes a buffer


@pytest.mark.parametrize("placement", ["cpu", "gpu", "hybrid"], ids=lambda p: f"{p}-mode")
def test_resident_share_in_every_mode_equals_one_engine(placement):
    """``gpu_state_bytes=70000``: slots 0 (5000 elements, 40000 bytes) and 1 (3000, 24000)
    fit and 3 (100, 800) still does after 2 (7000) did not: resident on the device
    placement; the rest as the mode says (hybrid, element budget 7100: slot 2 on the
    device, not resident). Frozen parameters take none of the budget. The bits of one
    host placement doing everything; truncate gives the budget back."""
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    whole_p, split_p = _params(), _params()
    whole = H.HostPlacement(Backend(), threads=2, chunk_size=4096)
    gpu = FakeDevice()
    split = E.Engine(Backend(), mode=placement, device_elems=7100, gpu_state_bytes=70000, threads=2,
                     chunk_size=4096, _device=lambda: gpu)
    assert split.device is gpu
    assert (split.host is None) == (placement == "gpu")
    for p in whole_p:
        whole.add_param(p, p.size, "float32", "cpu")
    for p in split_p:
        split.add_param(p, p.size, "float32", "cpu")
    assert [split.has_gpu_state(s) for s in range(4)] == [True, True, False, True]
    assert [split.on_device(s) for s in range(4)] == [True, True, placement != "cpu", True]
    assert gpu.resident == [0, 1, 2 if placement == "cpu" else 3]
    rng = np.random.default_rng(3)
    for _ in range(4):
        grads = [rng.standard_normal(p.size).astype(np.float32) for p in whole_p]
        for sid, g in enumerate(grads):
            whole.offload_grad(sid, g, "float32")
        whole.step([(sid, hp) for sid in range(4)])
        for sid, g in enumerate(grads):
            if not split.on_device(sid):
                split.offload_grad(sid, g, "float32")
        split.step([(sid, hp, grads[sid], "float32") if split.on_device(sid) else (sid, hp) for sid in range(4)])
        whole.synchronize()
        split.synchronize()
    for a, b in zip(whole_p, split_p):
        assert np.array_equal(a, b)
    for sid in range(4):
        assert _same_state(whole.state(sid), split.state(sid))
    st = split.stats()
    assert st["gpu_state_params"] == 3 and st["gpu_state_numel"] == 8100 and st["gpu_state_bytes"] == 64800
    frozen = split.add_param(np.zeros(10, np.float32), 10, "float32", "cpu", trainable=False)
    assert not split.has_gpu_state(frozen)
    assert split.add_param(np.zeros(650, np.float32), 650, "float32", "cpu") == 5  # 5200 bytes: 70000 - 64800
    assert split.has_gpu_state(5)
    assert not split.has_gpu_state(split.add_param(np.zeros(1, np.float32), 1, "float32", "cpu"))  # none left
    split.truncate(3)  # slots 3 (resident), 4, 5 (resident), 6 dropped: their budget is free again
    assert split.add_param(np.zeros(750, np.float32), 750, "float32", "cpu") == 3
    assert split.has_gpu_state(3)
    with pytest.raises(IndexError, match="no parameter slot"):
        split.has_gpu_state(7)
    for bad in (-1, 7):  # a negative id does not wrap around to the last slot
        with pytest.raises(IndexError, match="no parameter slot"):
            split.wait_ready([bad])
        with pytest.raises(IndexError, match="no parameter slot"):
            split.step([], coefs={bad: 1.0})
    whole.close()
    split.close()


@pytest.mark.parametrize("placement", ["cpu", "hybrid"], ids=lambda p: f"{p}-mode")
def test_load_state_is_checked_before_either_placement_changes(placement):
    """Bad sizes and steps are refused by the engine for a host and a device slot alike, the
    state left as it was; after close() the stats count no host state."""
    gpu = FakeDevice()
    eng = E.Engine(Backend(), mode=placement, device_elems=5, threads=1, _device=lambda: gpu)
    sids = [eng.add_param(np.ones(5, np.float32), 5, "float32", "cpu"),
            eng.add_param(np.ones(3, np.float32), 3, "float32", "cpu")]
    assert [eng.on_device(s) for s in sids] == [placement == "hybrid", False]
    for sid, n in zip(sids, (5, 3)):
        eng.load_state(sid, {"exp_avg": np.full(n, 2.0), "exp_avg_sq": np.full(n, 3.0), "step": 4})
        z = np.zeros(n)
        for state, match in (({"exp_avg": np.zeros(n + 1), "exp_avg_sq": z, "step": 1},
                              f"exp_avg of parameter slot {sid} has {n + 1} elem"),
                             ({"exp_avg": z, "exp_avg_sq": np.zeros(n - 1), "step": 1},
                              f"exp_avg_sq of parameter slot {sid} has {n - 1}"),
                             ({"exp_avg": z, "exp_avg_sq": z, "step": 1, "master": np.zeros(2)},
                              f"master of parameter slot {sid} has 2"),
                             ({"exp_avg": z, "exp_avg_sq": z}, f"the state of parameter slot {sid} lacks 'step'"),
                             ({"exp_avg": z, "exp_avg_sq": z, "step": 1, "exp_avg_2": z}, "unknown state key"),
                             ({"exp_avg": z, "exp_avg_sq": z, "step": -1}, "step must be a non-negative integer, got -1"),
                             ({"exp_avg": z, "exp_avg_sq": z, "step": True}, "step must be a non-negative integer, got True"),
                             ({"exp_avg": z, "exp_avg_sq": z, "step": 1.5}, "step must be a non-negative integer, got 1.5")):
            with pytest.raises(ValueError, match=match):
                eng.load_state(sid, state)
        st = eng.state(sid)
        assert (st["exp_avg"] == 2).all() and (st["exp_avg_sq"] == 3).all() and st["step"] == 4
        assert "master" not in st  # float32 weights are the parameter
    eng.close()
    assert eng.stats()["host_state_bytes"] == 0 and eng.stats()["params"] == 0


def _train(whole, split, whole_p, rng, hp, steps=2):
    for _ in range(steps):
        grads = [rng.standard_normal(p.size).astype(np.float32) for p in whole_p]
        for sid, g in enumerate(grads):
            whole.offload_grad(sid, g, "float32")
            if not split.on_device(sid):
                split.offload_grad(sid, g, "float32")
        whole.step([(sid, hp) for sid in range(len(grads))])
        split.step([(sid, hp, grads[sid], "float32") if split.on_device(sid) else (sid, hp)
                    for sid in range(len(grads))])
        whole.synchronize()
        split.synchronize()


@pytest.mark.parametrize("placement", ["cpu", "hybrid"], ids=lambda p: f"{p}-mode")
def test_make_resident_moves_state_mid_training_and_keeps_the_bits(placement):
    """After 2 steps ``move_state_to_gpu(65000)`` moves slots 0 (40000 bytes), 1 (24000) and 3 (800)
    into resident state, from the host or (hybrid: slots 0 and 3) the device share; slot 2 (56000)
    stays. 2 more steps: the bits of one host placement doing everything. The host buffers are
    freed, hybrid's device budget given back; a later slot takes what is left of the budget."""
    hp = C.AdamWHyperParams(1e-2, 0.9, 0.99, 1e-8, 0.1)
    whole_p, split_p = _params(), _params()
    whole = H.HostPlacement(Backend(), threads=2, chunk_size=4096)
    gpu = FakeDevice()
    split = E.Engine(Backend(), mode=placement, device_elems=7100, threads=2, chunk_size=4096,
                     gpu_state_later=True, _device=lambda: gpu)
    for a, b in zip(whole_p, split_p):
        whole.add_param(a, a.size, "float32", "cpu")
        split.add_param(b, b.size, "float32", "cpu")
    frozen = split.add_param(np.zeros(10, np.float32), 10, "float32", "cpu", trainable=False)
    assert [split.on_device(s) for s in range(4)] == [placement == "hybrid", False, False, placement == "hybrid"]
    rng = np.random.default_rng(3)
    _train(whole, split, whole_p, rng, hp)
    host_before = split.host.stats()["host_state_bytes"]  # (the fake device's state is host memory too)
    assert split.move_state_to_gpu(65000) == [0, 1, 3]
    assert [split.has_gpu_state(s) for s in range(5)] == [True, True, False, True, False] and not split.on_device(frozen)
    assert gpu.resident == [2, 3, 4] if placement == "hybrid" else gpu.resident == [0, 1, 2]
    assert split.device_elems_used == 0 and split.gpu_state_used == 64800
    st = split.stats()
    assert st["gpu_state_params"] == 3 and split.host.stats()["host_state_bytes"] < host_before
    assert split.host.stats()["params"] == 2  # slot 2 and the frozen one
    _train(whole, split, whole_p, rng, hp)
    for sid, (a, b) in enumerate(zip(whole_p, split_p)):
        assert np.array_equal(a, b), sid
        assert _same_state(whole.state(sid), split.state(sid))
        assert split.get_step(sid) == 4
    assert split.move_state_to_gpu(0) == []  # nothing more fits
    assert split.has_gpu_state(split.add_param(np.zeros(25, np.float32), 25, "float32", "cpu"))  # 200 bytes left
    split.truncate(5)
    assert not split.has_gpu_state(split.add_param(np.zeros(26, np.float32), 26, "float32", "cpu"))
    whole.close()
    split.close()


def test_make_resident_then_truncate_frees_what_it_drops():
    """hybrid: slots 0 and 2 on the device, 1 on the host; 1 moves (device id 2), then
    truncate(2) drops slot 2 (device id 1, before the kept id 2): freed, not left behind."""
    gpu = FakeDevice()
    eng = E.Engine(Backend(), mode="hybrid", device_elems=6000, threads=1, gpu_state_later=True,
                   _device=lambda: gpu)
    for n, dev in ((3000, True), (100, False), (3000, True)):
        eng.add_param(np.zeros(n, np.float32), n, "float32", "cpu", on_device=dev)
    assert eng.move_state_to_gpu(800) == [1]
    eng.truncate(2)
    assert gpu.e.stats()["params"] == 2 and eng.host.stats()["params"] == 0
    assert [eng.on_device(s) for s in range(2)] == [True, True] and eng.device_elems_used == 3000
    eng.close()


def test_make_resident_failing_partway_leaves_every_slot_consistent():
    """A failure loading the second slot's state: the first stays moved (resident, its host slot
    freed), the second where it was with its state, the device slot made for it dropped."""
    gpu = FakeDevice()
    eng = E.Engine(Backend(), mode="cpu", threads=1, gpu_state_later=True, _device=lambda: gpu)
    for p in _params():
        eng.add_param(p, p.size, "float32", "cpu")
    eng.load_state(1, {"exp_avg": np.full(3000, 2.0), "exp_avg_sq": np.full(3000, 3.0), "step": 5})
    load = gpu.load_state

    def failing(sid, *a):
        if sid == 1:
            raise RuntimeError("copy failed")
        return load(sid, *a)

    gpu.load_state = failing
    with pytest.raises(RuntimeError, match="copy failed"):
        eng.move_state_to_gpu(10**6)
    assert [eng.has_gpu_state(s) for s in range(4)] == [True, False, False, False]
    assert gpu.e.stats()["params"] == 1 and eng.host.stats()["params"] == 3
    st = eng.state(1)
    assert (st["exp_avg"] == 2).all() and (st["exp_avg_sq"] == 3).all() and st["step"] == 5
    eng.close()


def test_make_resident_stops_where_gpu_memory_is_refused():
    gpu = FakeDevice()
    add = gpu.add_param

    def refusing(param, numel, dtype, platform, *, gpu_state=False, init=True):
        if gpu_state and gpu.resident:
            raise MemoryError("could not allocate 24000 bytes of GPU memory")
        return add(param, numel, dtype, platform, gpu_state=gpu_state, init=init)

    gpu.add_param = refusing
    eng = E.Engine(Backend(), mode="cpu", threads=1, gpu_state_later=True, _device=lambda: gpu)
    for p in _params():
        eng.add_param(p, p.size, "float32", "cpu")
    with pytest.warns(RuntimeWarning, match="GPU memory for the state of slot 1 was refused"):
        assert eng.move_state_to_gpu(10**6) == [0]
    assert [eng.has_gpu_state(s) for s in range(4)] == [True, False, False, False]
    assert eng.gpu_state_budget == eng.gpu_state_used == 40000  # nothing more is tried
    assert not eng.has_gpu_state(eng.add_param(np.zeros(1, np.float32), 1, "float32", "cpu"))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
            eng.move_state_to_gpu(bad)
    eng.close()
    no_device = E.Engine(Backend(), mode="cpu", threads=1)
    with pytest.raises(RuntimeError, match="gpu_state_later=True"):
        no_device.move_state_to_gpu(100)
    no_device.close()


def test_resident_budget_counts_the_master_and_an_empty_budget_makes_no_device():
    """fp16/bf16 slots hold a master too (12 bytes an element); ``gpu_state_bytes=0`` in cpu
    mode builds no device placement; bad budgets are refused."""
    made = []

    def device():
        made.append(FakeDevice())
        return made[-1]

    eng = E.Engine(Backend(), mode="cpu", gpu_state_bytes=11999, threads=1, _device=device)
    assert eng.add_param(np.zeros(1000, np.float32), 1000, "bfloat16", "cpu") == 0
    assert not eng.has_gpu_state(0) and not eng.on_device(0)  # 12000 bytes
    assert eng.add_param(np.zeros(1000, np.float32), 1000, "float32", "cpu") == 1
    assert eng.has_gpu_state(1) and eng.on_device(1)  # 8000 bytes
    eng.close()
    eng = E.Engine(Backend(), mode="cpu", threads=1, _device=device)
    assert eng.device is None and len(made) == 1
    assert eng.stats()["gpu_state_bytes"] == 0
    eng.close()
    for bad in (-1, 1.5, True, "auto", None):
        with pytest.raises(ValueError, match="gpu_state_bytes must be an int >= 0"):
            E.Engine(Backend(), mode="cpu", gpu_state_bytes=bad, threads=1, _device=device)
    assert len(made) == 1  # refused before anything is built


def test_gpu_state_bytes_argument_checks():
    """OffloadAdamW(gpu_state_bytes=...): an int >= 0 or "auto"; a budget needs CUDA parameters
    (checked before any GPU code runs); 0 leaves CPU parameters alone; host_memory_plan counts
    "auto" as all offloaded (as it is until the first step)."""
    torch = pytest.importorskip("torch")
    from trainstream.torch import OffloadAdamW

    model = torch.nn.Linear(4, 4)
    for bad in (-1, 1.5, True, "half", None):
        with pytest.raises(ValueError, match="Invalid gpu_state_bytes"):
            OffloadAdamW(model.parameters(), gpu_state_bytes=bad)
    with pytest.raises(ValueError, match="gpu_state_bytes='auto' keeps state in GPU memory and needs CUDA"):
        OffloadAdamW(model.parameters(), gpu_state_bytes="auto")
    assert OffloadAdamW.host_memory_plan(model.parameters(), gpu_state_bytes="auto") == \
        OffloadAdamW.host_memory_plan(model.parameters())
    for mode in ("cpu", "hybrid"):
        with pytest.raises(ValueError, match="needs CUDA"):
            OffloadAdamW(model.parameters(), mode=mode, gpu_state_bytes=1 << 20)
    with pytest.raises(ValueError, match="gpu_state_bytes=4096 keeps state in GPU memory and needs CUDA parameters"):
        OffloadAdamW(model.parameters(), gpu_state_bytes=4096)
    opt = OffloadAdamW(model.parameters(), gpu_state_bytes=np.int64(0), threads=1)
    assert opt.stats()["gpu_state_bytes"] == 0 and opt._engine.device is None
    opt.close()
