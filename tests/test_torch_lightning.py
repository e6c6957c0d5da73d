"""Lightning's ``Trainer`` running its own training loop with OffloadAdamW, bit for bit against the same Trainer with
``torch.optim.AdamW`` of the same flags (``fused`` default and ``True``): the LightningModule builds the optimizer in
its ``configure_optimizers`` (with a per-step LR scheduler); the Trainer accumulates 2 micro-batches, clips with its
own ``gradient_clip_val`` (norm or value) and precision plugin, saves with ``trainer.save_checkpoint`` after the first
epoch and resumes from it with ``fit(ckpt_path=...)``. Each setup trains three ways per optimizer (2 epochs; 1 epoch
and a checkpoint; the resume from it) and once more from the other optimizer's checkpoint; the weights, the
optimizer state and what ``on_before_optimizer_step`` sees are compared bitwise (this rank's shards).

* One device: on the CPU every precision plugin that runs there (``"16-mixed"`` through
  ``MixedPrecision("16-mixed", "cpu")`` and a GradScaler, with a step skipped for an inf); on a GPU (``gpu`` mark)
  the same setups and OffloadAdamW's GPU modes.
* Several processes, two ranks (``torch.multiprocessing.spawn``; Lightning takes them as two nodes of one device,
  so the same code runs two gloo ranks on one GPU): ``DDPStrategy``; ``ModelParallelStrategy`` (Lightning's FSDP2,
  ``fully_shard`` in ``configure_model``) with a distributed and a full checkpoint; ``FSDPStrategy`` (FSDP1, flat
  parameters with ``use_orig_params=True``), whose CPU run needs two changes to run at all (Lightning refuses a CPU
  accelerator for it, torch's FSDP1 wants ``device_id=cpu``): :class:`_CPUFSDPStrategy`. Its full checkpoint
  segfaults in torch's gather over two gloo ranks (``torch.optim.AdamW`` alone too), so it runs at world size 1
  (rank 0 alone, after the two-rank setups; NCCL on a GPU).
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import traceback
import warnings
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
dist = torch.distributed
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _torch_helpers import all_ranks, free_port, spawn_ranks  # noqa: E402
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402

from trainstream.torch import OffloadAdamW  # noqa: E402
from trainstream.torch.lightning import OffloadFSDPPrecision, OffloadMixedPrecision  # noqa: E402

CLIP = {"norm": 0.05, "value": 0.01}  # both below what the gradients reach (checked: "clipped")


def _net() -> nn.Module:
    """Widths 15 and 3: uneven shards over two ranks, and FSDP1's flat shards leave some parameters empty on a rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 15), nn.Tanh(), nn.Linear(15, 15), nn.Tanh(), nn.Linear(15, 3))


@dataclass(frozen=True)
class Setup:
    """One Trainer configuration, run with each optimizer. ``plugin``: OffloadAdamW's run takes trainstream's precision
    plugin (else both take Lightning's); ``ours``: OffloadAdamW's own arguments (``max_grad_norm`` replaces the
    Trainer's clipping in its run); ``inf_at``: (epoch, batch) whose loss is inf (GradScaler skips that step);
    ``manual``: Lightning's manual optimization, the same loop written in ``training_step``; ``reads``: a
    ``ModelCheckpoint`` every step and a callback reading ``state_dict()`` and the weights after every micro-batch."""

    precision: str = "32-true"
    fused: bool | None = None
    clip: str | None = "norm"
    plugin: bool = False
    strategy: str = "single"
    ours: dict = field(default_factory=dict)
    inf_at: tuple[int, int] | None = None
    manual: bool = False
    reads: bool = False

    @property
    def hooks_see_unscaled(self) -> bool:
        """Whether both optimizers' ``on_before_optimizer_step`` see the same gradients: not where Lightning's own
        plugin leaves a non-fused OffloadAdamW's unscaling to ``step()`` (it does so for fused optimizers only)."""
        return not (self.precision == "16-mixed" and not self.fused and not self.plugin)


class Module(pl.LightningModule):
    def __init__(self, kind: str, cfg: Setup):
        super().__init__()
        self.kind, self.cfg = kind, cfg
        self.automatic_optimization = not cfg.manual
        self.net = _net()
        self.seen: list[str] = []  # per optimizer step: the gradients' norm and largest magnitude, as hooks see them
        self.initial: list[torch.Tensor] = []  # this rank's shards when the optimizer is built

    def configure_model(self):
        if self.cfg.strategy.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, x, batch_idx):
        loss = self.net(x).float().square().mean()
        if (self.current_epoch, batch_idx) == self.cfg.inf_at:
            loss = loss * float("inf")
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()  # manual optimization: 2 micro-batches a step, clipping, the scheduler
        self.manual_backward(loss / 2)
        if batch_idx % 2:
            if self.cfg.clip:
                self.clip_gradients(opt, CLIP[self.cfg.clip], self.cfg.clip)
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()
        return None

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads and not any(hasattr(g, "to_local") for g in grads):
            flat = torch.cat([g.detach().flatten().float() for g in grads])
            if flat.numel():
                self.seen.append(f"{flat.norm().item().hex()} {flat.abs().max().item().hex()}")

    def configure_optimizers(self):
        """What a user writes: the optimizer over ``self.parameters()`` (FSDP2's DTensors after ``configure_model``,
        FSDP1's original parameters), with its LR scheduler."""
        self.initial = [_local(p) for p in self.net.parameters()]
        if self.kind == "ours":
            opt = OffloadAdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1,
                               fused=self.cfg.fused, threads=1, **self.cfg.ours)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1,
                                    fused=self.cfg.fused)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _Reads(pl.Callback):
    """Reads between micro-batches (the optimizer's state dict, the weights), as a logging callback may."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.optimizers[0].state_dict()
        [p.detach().sum().item() for p in pl_module.parameters()]


class _CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on the CPU, for the tests only: Lightning refuses a CPU accelerator for the strategy
    it names ``fsdp`` (not for a subclass), and torch's FSDP1 runs on the CPU when given ``device_id=cpu`` (Lightning
    passes the device's index, None). The wrapping is Lightning's ``_setup_model`` with that argument."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: PLC0415
        return FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                        mixed_precision=self.mixed_precision_config,
                                        sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                                        **self.kwargs)


def _strategy(setup: Setup, device: str):
    """Lightning's strategy for ``setup``, on the process group the job initialised (Lightning keeps it)."""
    name = setup.strategy
    if name == "single":
        return "auto"
    backend = dist.get_backend()
    if name == "ddp":
        return DDPStrategy(process_group_backend=backend)
    if name.startswith("fsdp2"):
        return ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1,
                                     save_distributed_checkpoint=name != "fsdp2_full", process_group_backend=backend)
    cls = _CPUFSDPStrategy if device == "cpu" else FSDPStrategy
    return cls(state_dict_type="full" if name == "fsdp1_full" else "sharded", process_group_backend=backend)


def _precision(setup: Setup, kind: str, device: str) -> dict:
    """The Trainer's precision arguments: a plugin instance for mixed precision (Lightning builds the same one from
    ``precision=``; "16-mixed" on the CPU needs it), trainstream's for OffloadAdamW where ``setup.plugin``."""
    p, ours = setup.precision, kind == "ours" and setup.plugin
    if setup.strategy.startswith("fsdp1"):
        plugin = (OffloadFSDPPrecision if ours else FSDPPrecision)(p)
        if p == "16-mixed":  # its own ShardedGradScaler, on this device and this job's group: the default device is
            # CUDA, the default group the one of the first import (torch binds dist.group.WORLD as a default
            # argument), and Lightning 2.6 refuses a scaler passed in (it reads self.precision before setting it)
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415
            plugin.scaler = ShardedGradScaler(device=device, process_group=dist.group.WORLD)
        return {"plugins": [plugin]}
    if p.endswith("-mixed"):
        return {"plugins": [(OffloadMixedPrecision if ours else MixedPrecision)(p, device)]}
    return {"precision": p}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu().clone()


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 8, generator=g) for _ in range(4)]


def _fit(kind: str, setup: Setup, device: str, folder: str, epochs: int, *, save=None, ckpt=None) -> dict:
    """One ``trainer.fit``: the weights, optimizer state and hooks' view at its end (this rank's shards)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    clip = None if setup.manual or (kind == "ours" and "max_grad_norm" in setup.ours) else setup.clip
    module = Module(kind, setup)
    trainer = pl.Trainer(
        max_epochs=epochs, accumulate_grad_batches=1 if setup.manual else 2, accelerator=device, devices=1,
        num_nodes=world,
        strategy=_strategy(setup, device), use_distributed_sampler=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=setup.reads,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=os.path.join(folder, f"{kind}-every-step"), save_top_k=-1,
                                                every_n_train_steps=1), _Reads()] if setup.reads else None,
        **(dict(gradient_clip_val=CLIP[clip], gradient_clip_algorithm=clip) if clip else {}),
        **_precision(setup, kind, device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no loader workers, FSDP1's CPU autocast, ...
        rank = dist.get_rank() if dist.is_initialized() else 0
        trainer.fit(module, torch.utils.data.DataLoader(_batches(rank), batch_size=None),
                    ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
    opt = trainer.optimizers[0]
    params = list(module.net.parameters())
    run = {"weights": [_local(p) for p in params], "seen": module.seen, "initial": module.initial,
           "state": {i: {k: _local(v) for k, v in opt.state[p].items()}
                     for i, p in enumerate(params) if p in opt.state},
           "lr": opt.param_groups[0]["lr"]}
    if isinstance(opt, OffloadAdamW):
        opt.close()
    return run


def _same(a: dict, b: dict, *, hooks: bool = True, partition: bool = False) -> bool:
    """Weights, state entries (FSDP1 keeps none for a parameter empty on this rank; with ``partition``, ``b`` only
    those of its ZeRO-1 partition), LR and hooks' view equal."""
    keys = b["state"].keys()
    return (len(a["weights"]) == len(b["weights"]) and all(map(torch.equal, a["weights"], b["weights"]))
            and (keys <= a["state"].keys() if partition else keys == a["state"].keys() and len(keys) > 0)
            and a["lr"] == b["lr"]
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                    for x, y in ((a["state"][i], b["state"][i]) for i in keys))
            and (not hooks or a["seen"] == b["seen"]))


def _compare(setup: Setup, device: str, folder: str) -> dict[str, bool]:
    """The three runs of each optimizer and each one's resume from the other's checkpoint, compared."""
    runs = {}
    for kind in ("adamw", "ours"):
        runs[kind] = _fit(kind, setup, device, folder, 2)
        _fit(kind, setup, device, folder, 1, save=os.path.join(folder, f"{kind}.ckpt"))
        runs[kind, "resumed"] = _fit(kind, setup, device, folder, 2, ckpt=os.path.join(folder, f"{kind}.ckpt"))
    runs["ours", "from_adamw"] = _fit("ours", setup, device, folder, 2, ckpt=os.path.join(folder, "adamw.ckpt"))
    runs["adamw", "from_ours"] = _fit("adamw", setup, device, folder, 2, ckpt=os.path.join(folder, "ours.ckpt"))
    kw = {"hooks": setup.hooks_see_unscaled, "partition": setup.ours.get("zero_stage") == 1}
    ref = runs["adamw"]
    checks = {"adamw_resume_exact": _same(ref, runs["adamw", "resumed"], hooks=False),  # the harness itself
              "bitwise": _same(ref, runs["ours"], **kw),
              "resumed_bitwise": _same(runs["adamw", "resumed"], runs["ours", "resumed"], **kw),
              "from_adamw_bitwise": _same(runs["adamw", "resumed"], runs["ours", "from_adamw"], **kw),
              "adamw_from_ours": _same(runs["adamw", "resumed"], runs["adamw", "from_ours"]),
              "trained": all(not torch.equal(a, b) for a, b in zip(ref["initial"], ref["weights"]) if a.numel())}
    if setup.clip and ref["seen"] and not setup.manual:  # before clipping (where the hooks see plain tensors)
        seen = [float.fromhex(s.split()[setup.clip == "value"]) for s in ref["seen"]]
        checks["clipped"] = any(v > CLIP[setup.clip] for v in seen if v < float("inf"))
    return checks


def _assert_checks(checks: dict) -> None:
    failed = [k for k, ok in checks.items() if not ok]
    assert not failed, f"checks failed: {failed}"


# -- one device -------------------------------------------------------------------------------------

ONE_DEVICE = {
    "32-true-reads": Setup(reads=True),
    "32-true-fused-value": Setup(fused=True, clip="value"),
    "bf16-true-value": Setup("bf16-true", clip="value"),
    "bf16-true-fused": Setup("bf16-true", fused=True),
    "16-true": Setup("16-true"),
    "16-true-fused-value": Setup("16-true", fused=True, clip="value"),
    "bf16-mixed-plugin": Setup("bf16-mixed", plugin=True),
    "bf16-mixed-plugin-value": Setup("bf16-mixed", clip="value", plugin=True),
    "bf16-mixed-max_grad_norm": Setup("bf16-mixed", ours={"max_grad_norm": CLIP["norm"]}),
    "bf16-mixed-fused-noclip": Setup("bf16-mixed", fused=True, clip=None),
    "16-mixed-plugin-reads": Setup("16-mixed", plugin=True, inf_at=(1, 1), reads=True),
    "16-mixed-plugin-value": Setup("16-mixed", clip="value", plugin=True, inf_at=(1, 1)),
    "16-mixed-noclip": Setup("16-mixed", clip=None, inf_at=(1, 1)),
    "16-mixed-fused-noclip": Setup("16-mixed", fused=True, clip=None, inf_at=(1, 1)),
    "manual-32-true": Setup(manual=True),
    "manual-16-mixed-plugin-value": Setup("16-mixed", clip="value", plugin=True, inf_at=(1, 1), manual=True),
}
GPU_ONLY = {
    "gpu-mode-16-mixed-plugin": Setup("16-mixed", plugin=True, ours={"mode": "gpu"}, inf_at=(1, 1)),
    "hybrid-bf16-true": Setup("bf16-true", ours={"mode": "hybrid", "gpu_share": 0.5}),
}


@pytest.mark.parametrize("name", list(ONE_DEVICE))
def test_one_device_cpu(tmp_path, name):
    _assert_checks(_compare(ONE_DEVICE[name], "cpu", str(tmp_path)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ONE_DEVICE) + list(GPU_ONLY))
def test_one_device_gpu(tmp_path, name):
    _assert_checks(_compare({**ONE_DEVICE, **GPU_ONLY}[name], "cuda", str(tmp_path)))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_clipping_refusals(tmp_path, precision):
    """Lightning's MixedPrecision refuses ``gradient_clip_val`` for an optimizer whose ``step()`` unscales
    (``_step_supports_amp_scaling``: torch's fused ones, OffloadAdamW always); OffloadMixedPrecision lifts it for a
    non-fused OffloadAdamW only (as for ``torch.optim.AdamW()``, tested above) and keeps it where torch's fused
    AdamW gets it."""
    refused = "does not allow for gradient clipping"
    with pytest.raises(RuntimeError, match=refused):
        _fit("ours", Setup(precision), "cpu", str(tmp_path), 1)
    for kind in ("adamw", "ours"):
        with pytest.raises(RuntimeError, match=refused):
            _fit(kind, Setup(precision, fused=True, plugin=True), "cpu", str(tmp_path), 1)


# -- several processes ------------------------------------------------------------------------------

#: Two ranks (gloo; on a GPU both share it).
TWO_RANKS = {
    "ddp": Setup(strategy="ddp"),
    "ddp-zero1": Setup(strategy="ddp", ours={"zero_stage": 1}),  # Lightning consolidates it on rank 0 to save
    "fsdp2": Setup(strategy="fsdp2"),
    "fsdp2_full-bf16-true-value": Setup("bf16-true", clip="value", strategy="fsdp2_full"),
    "fsdp1-value": Setup(clip="value", strategy="fsdp1"),
    "fsdp1-16-mixed-plugin-value": Setup("16-mixed", clip="value", plugin=True, strategy="fsdp1", inf_at=(1, 1)),
}
#: Then rank 0 alone (gloo; NCCL on a GPU): FSDP1 at world size 1 (its NO_SHARD), with its full checkpoint, which
#: over gloo with two ranks segfaults in torch's gather (torch.optim.AdamW alone too).
ONE_RANK = {
    "world1-fsdp1_full-value": Setup(clip="value", strategy="fsdp1_full"),
    "world1-fsdp1_full-bf16-mixed-fused-noclip": Setup("bf16-mixed", fused=True, clip=None, strategy="fsdp1_full"),
    "world1-fsdp1-16-mixed-plugin-value": TWO_RANKS["fsdp1-16-mixed-plugin-value"],
}
JOBS = [(2, TWO_RANKS), (1, ONE_RANK)]
#: Full checkpoints of CUDA tensors over gloo: torch's FSDP2 gather segfaults there, torch.optim.AdamW alone too
#: (tests/test_torch_dist.py's GLOO_CUDA_CRASH).
GLOO_CUDA_CRASH = {"fsdp2_full-bf16-true-value"}


def _rank_main(rank: int, world: int, port: int, out: str, device: str, ports: list[int]) -> None:
    """One rank: each job's setups in turn, in a process group of the job's ranks (gloo; NCCL for one rank on a GPU)
    that Lightning finds initialised and keeps. Lightning sees the ranks as nodes of one device each."""
    faulthandler.enable()
    torch.set_num_threads(1)  # two ranks on CI's 2 cores
    if device == "cuda":
        torch.cuda.set_device(0)
    results: dict[str, dict] = {}
    name = "(process group)"

    def dump():  # after each setup: a rank that crashes (a signal) keeps what ran
        with open(os.path.join(out, f"results{rank}.json"), "w") as f:
            json.dump(results, f)
    try:
        for (size, setups), job_port in zip(JOBS, [port, *ports]):
            if rank >= size:
                break
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job_port), NODE_RANK=str(rank), LOCAL_RANK="0",
                              WORLD_SIZE=str(size), RANK=str(rank))
            backend = "nccl" if device == "cuda" and size == 1 else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=180),
                                    **({"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}))
            try:
                for name, setup in setups.items():
                    if device == "cuda" and size > 1 and name in GLOO_CUDA_CRASH:
                        continue
                    folder = os.path.join(out, name)
                    os.makedirs(folder, exist_ok=True)
                    checks = _compare(setup, device, folder)
                    results[name] = {"checks": all_ranks(checks)}
                    dump()
            finally:
                dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported by the tests of this setup and the next
        results[name] = {"error": f"rank {rank}: {traceback.format_exc()[-12000:]}"}
    finally:
        dump()


def _spawn(tmp_path_factory, device: str) -> dict:
    return spawn_ranks(_rank_main, 2, tmp_path_factory.mktemp(f"lightning_{device}"), device,
                       [free_port() for _ in JOBS[1:]])


def _check(results: dict, name: str) -> None:
    r = results.get(name)
    if r is None:
        errors = "; ".join(v["error"] for v in results.values() if isinstance(v, dict) and "error" in v)
        pytest.fail(f"{name} did not run ({results['__failure__'] or 'an earlier setup failed'}): {errors}")
    assert "error" not in r, r["error"]
    _assert_checks(r["checks"])


@pytest.fixture(scope="module")
def several_cpu(tmp_path_factory):
    return _spawn(tmp_path_factory, "cpu")


@pytest.fixture(scope="module")
def several_gpu(tmp_path_factory):
    return _spawn(tmp_path_factory, "cuda")


@pytest.mark.parametrize("name", [*TWO_RANKS, *ONE_RANK])
def test_several_processes_cpu(several_cpu, name):
    _check(several_cpu, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*TWO_RANKS, *ONE_RANK])
def test_several_processes_one_gpu(request, name):
    if name in GLOO_CUDA_CRASH:
        pytest.skip("torch's full-state gather of CUDA tensors over gloo segfaults (torch.optim.AdamW alone too)")
    _check(request.getfixturevalue("several_gpu"), name)
