"""torchtitan's Llama3 trained by torchtitan's own loop (``Trainer.train``, one GPU, FSDP2 with bf16 compute,
selective activation checkpointing) with three optimizers' placements, each in a fresh process:

- ``offload``: ``trainstream.torch.OffloadAdamW`` through its torchtitan override (``--mode``: cpu, hybrid, gpu);
- ``cpu_offload``: torchtitan's own offload, ``training.enable_cpu_offload`` (FSDP2's ``CPUOffloadPolicy``:
  parameters, gradients and torch's fused AdamW on the host);
- ``gpu``: torchtitan's AdamW in GPU memory (where it fits; an out-of-memory is reported as such).

Per variant: the median step time after ``--warmup`` steps (each step timed to a CUDA synchronize), tokens/s,
peak GPU memory (allocated and reserved) and the process's peak resident host memory, as one JSON line; then a
table and the step-time ratio of ``cpu_offload`` to ``offload``. Synthetic tokens, no checkpoints. Issue 38 item 4,
on the H100 (80 GB GPU, 128 GiB host), where torchtitan's AdamW does not fit 5.4B parameters and FSDP2's
CPUOffloadPolicy still fits the host:

    python3 experiments/bench_titan.py --flavor 8B --layers 20 --seq-len 8192 --steps 4 --warmup 2 \\
        --variants offload,cpu_offload,gpu --json bench_titan.json

Needs torchtitan 0.3.0 (and triton, which it imports); with torch 2.13 or older ``--spmd-backend
partial_dtensor`` (the default here) and an alias of ``torch.distributed.set_timeout`` (made here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERRIDE = "trainstream.torch.torchtitan.offload_adamw"


def _child(args: argparse.Namespace) -> dict:
    """One variant in this process (world size 1): torchtitan's trainer, timed."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if not hasattr(dist, "set_timeout"):  # torchtitan 0.3.0 calls the name newer torch gives _set_pg_timeout
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    spec = importlib.util.spec_from_file_location("_titan", HERE / "_titan.py")
    titan = sys.modules["_titan"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(titan)
    config = titan.llama3(args.flavor, n_layers=args.layers)
    config.dump_folder = args.dump
    config.debug.seed = 0
    config.parallelism.spmd_backend = args.spmd_backend
    config.training.seq_len, config.training.local_batch_size = args.seq_len, args.batch
    config.training.steps = args.warmup + args.steps
    config.training.disable_cuda_graphs = True
    config.checkpoint.enable = False
    config.compile.enable = args.compile
    if args.child == "offload":
        config.override.imports = [(OVERRIDE, {"mode": args.mode, **json.loads(args.offload_args)})]
    elif args.child == "cpu_offload":
        config.training.enable_cpu_offload = True
    result: dict = {"variant": args.child if args.child != "offload" else f"offload:{args.mode}",
                    "flavor": args.flavor, "layers": args.layers, "seq_len": args.seq_len, "batch": args.batch}
    times: list[float] = []
    try:
        trainer = config.build()
        result["params"] = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        step = trainer.train_step

        def timed(data_iterator):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(data_iterator)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)

        trainer.train_step = timed
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        optimizer = trainer.optimizers.optimizers[0]
        if hasattr(optimizer, "stats"):
            stats = optimizer.stats()
            result["host_state_bytes"] = stats.get("host_state_bytes")
            result["spec_steps_committed"] = stats.get("spec_steps_committed")
    except (torch.OutOfMemoryError, MemoryError) as e:
        result["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    measured = times[args.warmup:]
    result["step_times_s"] = [round(t, 4) for t in times]
    if measured:
        median = statistics.median(measured)
        result["step_s"] = round(median, 4)
        result["tokens_per_s"] = round(args.seq_len * args.batch / median, 1)
    result["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    result["peak_host_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return result


def _run_variant(variant: str, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    command = [sys.executable, __file__, "--child", variant] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("child", "variants", "json", "timeout", "compile") and v is not None]
    command += ["--compile"] if args.compile else []
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{\"variant\"")]
    if not lines:
        return {"variant": variant, "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="8B", help="torchtitan's Llama3 flavor (debugmodel, 1B, 3B, 8B, 70B)")
    parser.add_argument("--layers", type=int, default=None, help="keep the flavor's first N layers")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mode", default="cpu", help="OffloadAdamW's mode for the offload variant")
    parser.add_argument("--offload-args", default="{}", help="more OffloadAdamW arguments, JSON")
    parser.add_argument("--spmd-backend", default="partial_dtensor")
    parser.add_argument("--compile", action="store_true", help="torchtitan's torch.compile of model and loss")
    parser.add_argument("--variants", default="offload,cpu_offload")
    parser.add_argument("--dump", default="/tmp/bench_titan")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)), flush=True)
        return
    results = []
    for variant in args.variants.split(","):
        results.append(_run_variant(variant, args))
        print(json.dumps(results[-1]), flush=True)
    print(f"{'variant':<14} {'step s':>8} {'tokens/s':>9} {'GPU GiB':>8} {'host GiB':>9}  error")
    for r in results:
        print(f"{r['variant']:<14} {r.get('step_s', float('nan')):>8} {r.get('tokens_per_s', float('nan')):>9} "
              f"{r.get('peak_gpu_reserved_gib', float('nan')):>8} {r.get('peak_host_rss_gib', float('nan')):>9}  "
              f"{r.get('error', '')[:120]}")
    steps = {r["variant"].split(":")[0]: r.get("step_s") for r in results}
    if steps.get("offload") and steps.get("cpu_offload"):
        print(f"cpu_offload / offload step time: {steps['cpu_offload'] / steps['offload']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
