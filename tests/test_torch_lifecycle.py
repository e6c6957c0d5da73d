"""The optimizer's lifecycle in the loops users run: wrappers that copy it (Lightning's
LightningOptimizer), ``os.fork()``, several processes (the gradients taken at step()) and a
parameter listed twice (refused)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from trainstream.torch import OffloadAdamW  # noqa: E402


def _pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    return model, ref


def _step(model, opt, x, last=False):
    opt.zero_grad()
    loss = model(x).square().mean()
    if last:
        with opt.last_micro_batch():
            loss.backward()
    else:
        loss.backward()
    opt.step()


def _assert_same(model, ref, opt):
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


class _CopyingWrapper:
    """Lightning's LightningOptimizer: a copy of the optimizer's ``__dict__`` (less ``step``
    and ``__del__``) in an object of a class made from the wrapper's and the optimizer's."""

    def __init__(self, optimizer):
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")}
        self.__class__ = type("Lightning" + optimizer.__class__.__name__,
                              (self.__class__, optimizer.__class__), {})
        self._optimizer = optimizer

    def step(self, closure=None):
        return self._optimizer.step(closure)


def test_a_wrapper_that_copies_the_optimizer_never_closes_it():
    model, ref = _pair()
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in range(3):
        wrapper = _CopyingWrapper(opt)  # Lightning makes one per fit/step call
        x = torch.randn(5, 8)
        _step(model, wrapper, x)
        _step(ref, ropt, x)
        del wrapper
        gc.collect()
    _assert_same(model, ref, opt)
    opt.close()


def test_real_lightning_optimizer_wrapper():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model, ref = _pair(1)
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        wrapped = LightningOptimizer(opt)
        x = torch.randn(5, 8)
        _step(model, opt, x)
        _step(ref, ropt, x)
        del wrapped
        gc.collect()
    _assert_same(model, ref, opt)
    opt.close()
    del pl


def test_the_optimizer_itself_is_collected_and_releases_its_engine():
    model, _ = _pair()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, threads=2)
    engine = opt._engine
    _step(model, opt, torch.randn(5, 8))
    del opt
    gc.collect()
    assert engine.closed
    model(torch.randn(2, 8))  # no hook of the dead optimizer is left in the way


_FORK_SCRIPT = r"""
import os, sys, time
import torch
from trainstream.torch import OffloadAdamW

child = sys.argv[1]
torch.manual_seed(2)
model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
ref = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
ref.load_state_dict(model.state_dict())
opt = OffloadAdamW(model.parameters(), lr=1e-2, threads=2)
ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
x = torch.randn(64, 8)
ropt.zero_grad(); ref(x).square().mean().backward(); ropt.step()
opt.zero_grad()
with opt.last_micro_batch():  # host updates queued during backward, running at the fork
    model(x).square().mean().backward()
pid = os.fork()
if pid == 0:
    if child == "use":
        try:
            opt.step(); opt.synchronize()
        except RuntimeError as e:
            sys.exit(0 if "os.fork()" in str(e) else 4)
        sys.exit(3)
    sys.exit(0)  # interpreter exit: the optimizer's finalizers run in the child
t0 = time.monotonic()
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if time.monotonic() - t0 > 60:
        os.kill(pid, 9); print("child hung"); sys.exit(5)
    time.sleep(0.05)
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
opt.step()
for _ in range(2):
    x = torch.randn(64, 8)
    for m, o in ((model, opt), (ref, ropt)):
        o.zero_grad(); m(x).square().mean().backward(); o.step()
opt.synchronize()
assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("child", ["exit", "use"])
def test_fork_with_work_queued_never_hangs_the_child(child):
    """Fork right after an eager backward queued the host updates: a child that exits
    (``sys.exit``, finalizers and all) does so at once; a child that uses the parent's
    optimizer gets a clear error; the parent trains on, bit-identical to torch.optim.AdamW."""
    r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, child], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_several_processes_take_plain_gradients_at_step(tmp_path, monkeypatch):
    """One process (DDP over a group of one included) trains as torch.optim.AdamW does, the
    eager path included. With several processes the gradients of plain parameters are taken
    at step() (after DDP's all-reduce), the hooks copy none, and last_micro_batch() is
    refused with a clear error (tests/test_torch_dist.py runs real ranks)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        model, ref = _pair()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = OffloadAdamW(ddp.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for i in range(3):
            x = torch.randn(5, 8)
            _step(ddp, opt, x, last=i == 2)
            _step(ref, ropt, x)
        _assert_same(model, ref, opt)
        opt.zero_grad()  # the last _step leaves its gradients (as torch's: last_micro_batch() keeps them)
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        for _ in range(2):
            x = torch.randn(5, 8)
            before = opt.stats()["grad_bytes_offloaded"]
            ddp(x).square().mean().backward()
            assert opt.stats()["grad_bytes_offloaded"] == before  # no copy in the hooks
            opt.step()
            opt.zero_grad()
            _step(ref, ropt, x)
        _assert_same(model, ref, opt)
        with pytest.raises(NotImplementedError, match="unreduced gradients"):
            _step(ddp, opt, torch.randn(5, 8), last=True)
        opt.close()
    finally:
        dist.destroy_process_group()


def test_a_construction_failing_partway_leaves_nothing_on_the_parameters(monkeypatch):
    """A failure while registering the second parameter (here a refused allocation): the first
    one's gradient hook is removed before the error reaches the caller, even while the error
    (its traceback, holding the half-built optimizer) is kept, and the model trains on."""
    from trainstream.core import Engine

    model, ref = _pair()
    add, calls = Engine.add_param, []

    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("could not allocate the state of parameter 1")
        return add(self, *a, **k)

    monkeypatch.setattr(Engine, "add_param", failing)
    with pytest.raises(MemoryError, match="parameter 1") as caught:
        OffloadAdamW(model.parameters())
    assert caught.value.__traceback__ is not None  # the half-built optimizer is still referenced
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    monkeypatch.undo()
    opt, ref_opt = OffloadAdamW(model.parameters(), threads=1), torch.optim.AdamW(ref.parameters())
    x = torch.randn(4, 8)
    for _ in range(2):
        _step(model, opt, x)
        _step(ref, ref_opt, x)
    _assert_same(model, ref, opt)
    opt.close()


def test_a_parameter_listed_twice_is_refused_at_step():
    """torch warns at construction (its error input) and updates such a parameter once per listing; ours warns
    the same and refuses the step that would update it, before anything changes."""
    model, _ = _pair()
    w = model[0].weight
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="duplicate"):
        opt = OffloadAdamW([w, model[0].bias, w], lr=1e-2)
    model(x).sum().backward()
    before = w.detach().clone()
    with pytest.raises(NotImplementedError, match="more than once"):
        opt.step()
    assert torch.equal(w.detach(), before)
    opt.close()
    opt = OffloadAdamW([{"params": [w]}], lr=1e-2)
    with pytest.warns(UserWarning, match="duplicate"):
        opt.add_param_group({"params": [model[2].weight, model[2].weight]})
    with pytest.raises(NotImplementedError, match="param group 1 lists a parameter more than once"):
        opt.step()
    opt.zero_grad()
    opt.step()  # no gradient: nothing to refuse
    opt.close()


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_compiled_model_trains_bit_identically(how):
    """Dynamo does not trace the optimizer's forward gate (it runs eagerly); the compiled
    model waits for its weights and trains to torch.optim.AdamW's bits, eager path too."""
    def compiled(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
        if how == "torch.compile":
            return m, torch.compile(m)
        m.compile()
        return m, m

    model, cmodel = compiled(3)
    ref, cref = compiled(3)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, threads=2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: global module hooks fire once more for an OptimizedModule
        for i in range(4):
            x = torch.randn(32, 64)
            _step(cmodel, opt, x, last=i % 2 == 1)
            _step(cref, ropt, x)
    _assert_same(model, ref, opt)
    opt.close()
