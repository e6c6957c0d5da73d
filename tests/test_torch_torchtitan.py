"""Issue 38's torchtitan acceptance: torchtitan's own trainer (``Trainer.train``: FSDP2 with bf16 compute, selective
activation checkpointing, its LR scheduler and gradient clipping over DTensors, its DCP checkpointer) trains bit for
bit as with its own ``torch.optim.AdamW`` (``implementation="fused"``) when its config activates
``trainstream.torch.torchtitan.offload_adamw`` (``override.imports``, as ``--override.imports`` does on its command
line): every rank's shards and state after 4 steps, a resume from the step-2 checkpoint, and checkpoints moved between
the two optimizers both ways.

On the CPU: two gloo ranks (``torch.multiprocessing.spawn``). torchtitan 0.3.0 takes ``cuda`` as its device type
where torch finds no accelerator (``torchtitan.tools.utils.get_device_info``); each rank makes torch report ``cpu``
before importing torchtitan, with a stand-in for the CUDA memory queries of its metrics (``_cpu_device``); the
training loop is torchtitan's, unchanged. The model is its Llama3 with SDPA attention (FlexAttention has no backward
on the CPU), 2 layers of width 64, on synthetic tokens (``experiments/_titan.py``); no ``torch.compile`` on the CPU
(the GPU test compiles). torchtitan 0.3.0 calls ``torch.distributed.set_timeout``, which torch 2.13 names
``distributed_c10d._set_pg_timeout``: aliased where missing.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import socket
import sys
import time
import traceback
import types

import pytest

torch = pytest.importorskip("torch")
if sys.version_info < (3, 11) or importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan (Python >= 3.11) is not installed", allow_module_level=True)
dist = torch.distributed
if not hasattr(importlib.import_module("torch.distributed.fsdp"), "DataParallelMeshDims"):  # torch 2.11 lacks it
    pytest.skip(f"torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch {torch.__version__} "
                "does not have", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

from _experiments import EXPERIMENTS  # noqa: E402

STEPS, INTERVAL = 4, 2
OVERRIDE = "trainstream.torch.torchtitan.offload_adamw"


def _load_titan():
    """``experiments/_titan.py`` as the module ``_titan`` (registered: its Config dataclasses need their module)."""
    spec = importlib.util.spec_from_file_location("_titan", EXPERIMENTS / "_titan.py")
    module = sys.modules["_titan"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_device() -> None:
    """Before torchtitan's import: torch reports ``cpu`` as its accelerator, and ``torch.cpu`` stands in for
    ``torch.cuda`` in torchtitan's memory monitor (no memory statistics: torchtitan logs -1)."""
    import torch._utils  # noqa: PLC0415

    module = types.SimpleNamespace(
        get_device_name=lambda device=None: "cpu", current_device=lambda: 0,
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 34),
        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
        memory_stats=lambda device=None: {}, synchronize=lambda device=None: None, set_device=lambda device: None,
        device_count=lambda: 1)
    get_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind: module if kind == "cpu" else get_module(kind)


def _gloo_reductions() -> None:
    """torchtitan sets FSDP's gradient divide factor to 1.0 (it scales by the global token count itself), which
    FSDP2 reduces with ``ReduceOp.PREMUL_SUM(1.0)``: NCCL has it, gloo does not. Under gloo FSDP is told to reduce
    with ``SUM`` (its ``set_force_sum_reduction_for_comms``): the same sums, the factor 1.0 not applied."""
    import torchtitan.distributed.fsdp as fsdp  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    divide = fsdp.disable_fsdp_gradient_division

    def sum_reductions(model: torch.nn.Module) -> None:
        divide(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_reductions


def _quiet_trainer() -> None:
    """torchtitan's ``train()`` ends with a 2 s sleep on rank 0 ("for other ranks to complete"); skipped here."""
    import torchtitan.trainer as trainer  # noqa: PLC0415

    trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda seconds: None)


def _train(titan, folder: str, *, offload: bool, device: str, compile_model: bool = False, graphs: bool = False):
    """One ``Trainer.train()`` of STEPS steps in ``folder`` (resuming from the latest checkpoint there, as
    torchtitan does): the local shards of the weights and of the optimizer state, the optimizer's class and whether
    every weight (of this rank's non-empty shards) changed."""
    config = titan.tiny_llama3()
    config.dump_folder = folder
    config.debug.seed = 0
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.steps, config.training.seq_len, config.training.local_batch_size = STEPS, 16, 2
    config.training.disable_cuda_graphs = not graphs  # torchtitan's default captures forward+backward (graphs=True)
    config.checkpoint.enable, config.checkpoint.interval = True, INTERVAL
    config.checkpoint.last_save_model_only = False
    config.compile.enable = compile_model
    if offload:
        config.override.imports = [(OVERRIDE, {"threads": 1} if device == "cpu" else {})]
    trainer = config.build()
    try:
        params = list(trainer.model_parts[0].parameters())
        initial = [p.detach().to_local().cpu().clone() for p in params]
        trainer.train()
        optimizer = trainer.optimizers.optimizers[0]
        weights = [p.detach().to_local().cpu().clone() for p in params]
        state = [[optimizer.state[p][k].to_local().cpu().clone() for k in ("exp_avg", "exp_avg_sq")]
                 + [optimizer.state[p]["step"].cpu().clone()] for p in params]
        moved = all(not torch.equal(a, w) for a, w in zip(initial, weights) if a.numel())
        return weights, state, (type(optimizer).__name__, moved)
    finally:
        trainer.close()
        if offload:
            trainer.optimizers.close()


def _seed_checkpoint(source: str, folder: str, rank: int) -> None:
    """``folder`` starts with ``source``'s step-INTERVAL checkpoint only (rank 0 copies; every rank waits)."""
    if rank == 0:
        shutil.copytree(os.path.join(source, "checkpoint", f"step-{INTERVAL}"),
                        os.path.join(folder, "checkpoint", f"step-{INTERVAL}"))
    dist.barrier()


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _scenario(titan, rank: int, out: str, device: str, compile_model: bool) -> dict[str, bool]:
    run = {name: os.path.join(out, name) for name in ("torch", "ours", "ours_resumed", "ours_from_torch",
                                                      "torch_from_ours")}
    w0, s0, kind0 = _train(titan, run["torch"], offload=False, device=device, compile_model=compile_model)
    w1, s1, kind1 = _train(titan, run["ours"], offload=True, device=device, compile_model=compile_model)
    checks = {"classes": (kind0[0], kind1[0]) == ("AdamW", "OffloadAdamW"), "moved": kind0[1] and kind1[1],
              "weights": _same(w0, w1), "state": all(_same(a, b) for a, b in zip(s0, s1)) and len(s0) == len(s1)}
    for name, source, offload in (("ours_resumed", "ours", True), ("ours_from_torch", "torch", True),
                                  ("torch_from_ours", "ours", False)):
        _seed_checkpoint(run[source], run[name], rank)
        w, s, _ = _train(titan, run[name], offload=offload, device=device, compile_model=compile_model)
        checks[name] = _same(w0, w) and all(_same(a, b) for a, b in zip(s0, s))
    return checks


def _messages(exc: BaseException) -> str:
    """Every message of an exception's chain (its causes and contexts): a capture that fails may wrap ours."""
    seen, out = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


def _graphs_scenario(titan, rank: int, out: str, device: str, compile_model: bool) -> dict[str, bool]:
    """torchtitan's default configuration (``training.disable_cuda_graphs=False``: its first step eager, the second
    captured in a CUDA graph and replayed from then on): torch's AdamW trains; OffloadAdamW refuses at the capture
    with the message that names the setting to change."""
    _, _, (_, torch_moved) = _train(titan, os.path.join(out, "torch"), offload=False, device=device, graphs=True)
    try:
        _train(titan, os.path.join(out, "ours"), offload=True, device=device, graphs=True)
    except Exception as exc:  # noqa: BLE001 - the refusal is the outcome checked
        text = _messages(exc)
        return {"torch_trains": torch_moved, "refused": "captured in a CUDA graph" in text
                and "training.disable_cuda_graphs=True" in text}
    return {"torch_trains": torch_moved, "refused": False}


def _rank_main(rank: int, world: int, port: int, out: str, device: str, compile_model: bool,
               scenario: str = "bitwise") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if device == "cpu":
        _cpu_device()
    if not hasattr(dist, "set_timeout"):  # torchtitan 0.3.0 calls the name torch 2.14 gives it
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    results: dict = {}
    try:
        if world > 1 and device == "cuda":  # two ranks on one GPU: gloo (NCCL refuses); torchtitan keeps a group
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        titan = _load_titan()
        _quiet_trainer()
        if world > 1:
            _gloo_reductions()
        checks = (_graphs_scenario if scenario == "graphs" else _scenario)(titan, rank, out, device, compile_model)
        flags = torch.tensor([int(v) for v in checks.values()])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        results = {"checks": dict(zip(checks, map(bool, flags.tolist())))}
    except Exception:  # noqa: BLE001 - reported by the test
        results = {"error": f"rank {rank}: {traceback.format_exc()[-12000:]}"}
    finally:
        with open(os.path.join(out, f"results{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(tmp_path, world: int, device: str, compile_model: bool = False, scenario: str = "bitwise") -> dict:
    out = str(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(world, port, out, device, compile_model, scenario), nprocs=world)
    for rank in range(world):
        with open(os.path.join(out, f"results{rank}.json")) as f:
            result = json.load(f)
        if "error" in result:
            return result
    return result


def _assert_bitwise(result: dict) -> None:
    assert "error" not in result, result.get("error")
    failed = [k for k, ok in result["checks"].items() if not ok]
    assert not failed, f"checks failed on some rank: {failed}"


def test_torchtitan_fsdp2_two_ranks_cpu(tmp_path):
    """torchtitan's loop with OffloadAdamW (its override) equals it with torch.optim.AdamW, bit for bit: 4 steps,
    a resume from step 2, and its DCP checkpoints loaded by the other optimizer, both ways (2 gloo ranks)."""
    _assert_bitwise(_spawn(tmp_path, 2, "cpu"))


@pytest.mark.gpu
def test_torchtitan_one_gpu_compiled(tmp_path):
    """The same on one GPU (NCCL, world size 1), with torchtitan's torch.compile of the model and the loss."""
    _assert_bitwise(_spawn(tmp_path, 1, "cuda", compile_model=True))


@pytest.mark.gpu
def test_torchtitan_default_cuda_graphs_refused_at_capture(tmp_path):
    """torchtitan's default, CUDA graphs on (#40 item 4): refused at the capture, naming the setting to change."""
    _assert_bitwise(_spawn(tmp_path, 1, "cuda", scenario="graphs"))


@pytest.mark.gpu
def test_torchtitan_two_ranks_one_gpu(tmp_path):
    """The same with FSDP2 over two gloo ranks sharing one GPU."""
    _assert_bitwise(_spawn(tmp_path, 2, "cuda"))


# The extension point itself, in this process (no trainer): the configs torchtitan builds and what it passes.

def _titan_optimizer():
    from torchtitan.components import optimizer  # noqa: PLC0415
    from trainstream.torch import torchtitan as integration  # noqa: PLC0415

    return optimizer, integration


def test_offload_optimizers_renames_adam_groups():
    """AdamW/Adam groups become OffloadAdamW/OffloadAdam with their patterns and arguments; other names, the
    implementation and the factory arguments of other optimizers are kept; ours are merged per optimizer."""
    optimizer, integration = _titan_optimizer()
    config = optimizer.OptimizersContainer.Config(
        param_groups=[optimizer.ParamGroupConfig(pattern=r"bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 1.0}),
                      optimizer.ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                                 optimizer_kwargs={"lr": 2.0, "weight_decay": 0.5})],
        implementation="foreach", optimizer_factory_kwargs_by_name={"AdamW": {"threads": 3}, "DistMuon": {"x": 1}})
    ours = integration.offload_optimizers(config, mode="cpu")
    assert type(ours) is integration.OffloadOptimizersContainer.Config
    assert [(g.pattern, g.optimizer_name, g.optimizer_kwargs) for g in ours.param_groups] == [
        (r"bias$", "OffloadAdam", {"lr": 1.0}), (".*", "OffloadAdamW", {"lr": 2.0, "weight_decay": 0.5})]
    assert ours.implementation == "foreach"
    assert ours.optimizer_factory_kwargs_by_name == {"OffloadAdamW": {"threads": 3, "mode": "cpu"},
                                                     "OffloadAdam": {"mode": "cpu"}, "DistMuon": {"x": 1}}
    assert integration.offload_optimizers(ours) == ours  # applied twice: the same


def test_refusals_name_the_setting():
    """fused_opt_states_bf16 (bf16 moments of fp32 parameters) is refused where the config is turned and where the
    container is built; so are torch's hyper-parameters given as OffloadAdamW's own arguments, and max_grad_norm."""
    optimizer, integration = _titan_optimizer()
    bf16 = optimizer.default_adamw(lr=1e-3)
    bf16.implementation = "fused_opt_states_bf16"
    with pytest.raises(NotImplementedError, match="fused_opt_states_bf16"):
        integration.offload_optimizers(bf16)
    with pytest.raises(NotImplementedError, match="fused_opt_states_bf16"):
        integration.OffloadOptimizersContainer(integration.OffloadOptimizersContainer.Config(
            param_groups=bf16.param_groups, implementation="fused_opt_states_bf16"),
            model_parts=[torch.nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"\['lr'\]"):
        integration.offload_optimizers(optimizer.default_adamw(), lr=1.0)
    with pytest.raises(NotImplementedError, match="training.max_norm"):  # torchtitan clips param.grad itself
        integration.offload_optimizers(optimizer.default_adamw(), max_grad_norm=1.0)


def test_command_line_override():
    """torchtitan's command line (--override.imports with JSON arguments) swaps its optimizer config for ours."""
    from torchtitan.config import ConfigManager, apply_overrides  # noqa: PLC0415

    _, integration = _titan_optimizer()
    config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                         "--training.disable_cuda_graphs", "--override.imports",
                                         OVERRIDE + '={"threads": 1, "mode": "cpu"}'])
    assert config.training.disable_cuda_graphs
    assert config.override.imports == [(OVERRIDE, {"threads": 1, "mode": "cpu"})]
    apply_overrides(config.override, config)  # what Trainer.__init__ does before building the optimizer
    assert type(config.optimizer) is integration.OffloadOptimizersContainer.Config
    assert [g.optimizer_name for g in config.optimizer.param_groups] == ["OffloadAdamW"]
    assert config.optimizer.optimizer_factory_kwargs_by_name == {"OffloadAdamW": {"threads": 1, "mode": "cpu"}}


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_container_passes_torchtitans_arguments(implementation):
    """The container gives OffloadAdamW the param groups torchtitan gives torch.optim.AdamW (its fused/foreach,
    lr, betas, eps, weight_decay, param_names), and both train bit for bit, LR scheduler and clipping included."""
    import copy  # noqa: PLC0415

    optimizer, integration = _titan_optimizer()
    from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    models = [model, copy.deepcopy(model)]
    config = optimizer.default_adamw(lr=1e-2)
    config.implementation = implementation
    containers = [optimizer.OptimizersContainer(config, model_parts=[models[0]]),
                  integration.offload_optimizers(config, threads=1).build(model_parts=[models[1]])]
    torch_opt, ours = (c.optimizers[0] for c in containers)
    assert type(ours).__name__ == "OffloadAdamW"

    def groups(opt):
        return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    assert groups(ours) == groups(torch_opt)
    schedulers = [LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=c, training_steps=4)
                  for c in containers]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(4, 5, generator=g)
        for m, c, s in zip(models, containers, schedulers):
            m(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=True)
            c.step()
            s.step()
            c.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    assert groups(ours) == groups(torch_opt)  # the scheduler's lr, in both
    containers[1].close()


def test_example_config_registry(monkeypatch):
    """examples/torchtitan_llama3_offload.py is a config registry torchtitan's command line loads."""
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    _, integration = _titan_optimizer()
    monkeypatch.syspath_prepend(str(EXPERIMENTS.parent))
    config = ConfigManager().parse_args(["--module", "examples.torchtitan_llama3_offload",
                                         "--config", "llama3_8b_offload_hybrid"])
    assert config.training.disable_cuda_graphs
    assert type(config.optimizer) is integration.OffloadOptimizersContainer.Config
    assert config.optimizer.optimizer_factory_kwargs_by_name == {"OffloadAdamW": {"mode": "hybrid", "gpu_share": 0.3}}
    assert config.model_spec.flavor == "8B"
