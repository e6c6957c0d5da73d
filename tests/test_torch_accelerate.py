"""Accelerate loops, bit for bit against the same loop with ``torch.optim.AdamW``.

Issue 42: one process, ``accelerator.accumulate(model)`` with accumulation 4 (and the loop's
``accelerator.clip_grad_norm_`` on the steps that sync): Accelerate's gradient state marks the last micro-batch, whose
backward starts the host updates and uploads their weights (as ``last_micro_batch()``).

Issue 40's acceptance: Accelerate with FSDP2, the optimizer built on ``model.parameters()`` and prepared together
with the model as Accelerate's docs say (``accelerator.prepare(model, optimizer)``: ``fully_shard``, then
``fsdp2_switch_optimizer_parameters`` points the optimizer's groups at the new DTensor parameters), trains bit for
bit as the same run with ``torch.optim.AdamW``: every rank's shard after every step, the state entries too.

Two gloo ranks on the CPU (``torch.multiprocessing.spawn``). Accelerate 1.16 picks ``MULTI_CPU`` (DDP) on a CPU and
ignores the FSDP plugin there, so each rank sets ``distributed_type = FSDP`` on the accelerator's state after
building it (what Accelerate sets on GPUs); ``prepare`` then runs its own FSDP2 path (``_prepare_fsdp2``) unchanged.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
dist = torch.distributed
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

LR, WD, STEPS = 1e-2, 0.05, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 7), nn.GELU(), nn.Linear(7, 3))


def _accelerator():
    from accelerate import Accelerator  # noqa: PLC0415
    from accelerate.state import AcceleratorState, PartialState  # noqa: PLC0415
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: PLC0415
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    # On a CPU Accelerate chooses MULTI_CPU; FSDP is what it sets with GPUs (state.py), the rest is its own.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2
    return acc


def _scenario(rank: int, clip: float | None) -> dict[str, bool]:
    from trainstream.torch import OffloadAdamW  # noqa: PLC0415
    runs = []
    for cls, kw in ((torch.optim.AdamW, {}), (OffloadAdamW, {"threads": 1})):
        acc = _accelerator()  # one per run: its clip_grad_norm_ finds the model among its own
        model = _model()
        opt = cls(model.parameters(), lr=LR, weight_decay=WD, **kw)  # before prepare, as Accelerate's docs
        model, opt = acc.prepare(model, opt)
        runs.append((acc, model, opt))
    (_, m0, o0), (_, m1, o1) = runs
    checks = {"sharded": all(type(p).__name__ == "DTensor" for p in o1.param_groups[0]["params"]),
              "switched": all(p is q for p, q in zip(o1.param_groups[0]["params"], m1.parameters()))}
    initial = [p.to_local().clone() for p in m1.parameters()]
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x = torch.randn(4, 6, generator=g)
        for acc, model, opt in runs:
            acc.backward(model(x).square().mean())
            if clip is not None:
                acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        checks[f"step{step}"] = all(torch.equal(p.to_local(), q.to_local())
                                    for p, q in zip(m0.parameters(), m1.parameters()))
    checks["moved"] = all(not torch.equal(a, p.to_local()) for a, p in zip(initial, m1.parameters())
                          if a.numel())
    s0, s1 = o0.optimizer.state, o1.optimizer.state
    checks["state"] = len(s1) == len(s0) == 6 and all(
        torch.equal(s0[p][k].to_local(), s1[q][k].to_local()) for p, q in zip(m0.parameters(), m1.parameters())
        for k in ("exp_avg", "exp_avg_sq"))
    o1.optimizer.close()
    return checks


SCENARIOS = {"fsdp2_prepare": None, "fsdp2_prepare_clip": 0.05}


@pytest.mark.parametrize("clip", [None, 1e9, 1e-3], ids=["noclip", "clip-factor-1", "clip-every-step"])
def test_accelerate_accumulate_loop_bitwise(clip):
    """accelerator.accumulate with accumulation 4: torch's bits after every step; the fourth backward of each step
    speculates and uploads during backward (nothing rolled back at a hook); a clip factor of 1.0 commits, a smaller
    one redoes."""
    from accelerate import Accelerator  # noqa: PLC0415
    from accelerate.state import AcceleratorState, GradientState  # noqa: PLC0415

    from trainstream.torch import OffloadAdamW  # noqa: PLC0415

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    runs, moved = [], []
    try:
        for cls, kw in ((torch.optim.AdamW, {}), (OffloadAdamW, {"threads": 1})):
            reset()
            acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
            model = _model()
            opt = cls(model.parameters(), lr=LR, weight_decay=WD, **kw)
            model, opt = acc.prepare(model, opt)
            g = torch.Generator().manual_seed(0)
            weights = []
            for i in range(12):
                x = torch.randn(4, 6, generator=g)
                with acc.accumulate(model):
                    before = [p.detach().clone() for p in model.parameters()]
                    acc.backward(model(x).square().mean())
                    if cls is OffloadAdamW and acc.sync_gradients:
                        opt.optimizer._engine.drain()  # (the host updates run on worker threads)
                        moved.append(all(not torch.equal(p, b) for p, b in zip(model.parameters(), before)))
                    if clip is not None and acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), clip)
                    opt.step()
                    opt.zero_grad()
                if acc.sync_gradients:
                    weights.append([p.detach().clone() for p in model.parameters()])
            runs.append((weights, opt.optimizer))
        (want, _), (got, ours) = runs
        assert len(want) == len(got) == 3
        for step, (a, b) in enumerate(zip(want, got)):
            for p, q in zip(a, b):
                assert torch.equal(p, q), f"step {step}"
        assert moved == [True] * 3
        st = ours.stats()
        committed = 0 if clip == 1e-3 else 3
        assert (st["spec_steps_committed"], st["spec_steps_redone"]) == (committed, 3 - committed)
        assert st["spec_rolled_back"] == (3 - committed) * 6
        ours.close()
    finally:
        reset()


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name, clip in SCENARIOS.items():
            try:
                checks = _scenario(rank, clip)
            except Exception:  # noqa: BLE001 - reported by the test
                results[name] = {"error": f"rank {rank}: {traceback.format_exc()[-3000:]}"}
                break
            flags = torch.tensor([int(v) for v in checks.values()])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            results[name] = {"checks": dict(zip(checks, map(bool, flags.tolist())))}
    finally:
        with open(os.path.join(out, f"results{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, out), nprocs=2)
    merged: dict = {}
    for rank in (0, 1):
        with open(os.path.join(out, f"results{rank}.json")) as f:
            for name, r in json.load(f).items():
                if "error" in r or name not in merged:
                    merged[name] = r
    return merged


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_accelerate_fsdp2_prepare_bitwise(results, name):
    """The optimizer prepared with the model (Accelerate's FSDP2 path) trains as torch.optim.AdamW, bit for bit."""
    r = results.get(name)
    assert r is not None, "not run (an earlier scenario failed)"
    assert "error" not in r, r.get("error")
    failed = [k for k, ok in r["checks"].items() if not ok]
    assert not failed, f"checks failed on some rank: {failed}"
