# Run (GPU machine, N GPUs of one host): torchrun --standalone --nproc_per_node=N experiments/bench_fsdp.py --size 350m --batch 8 --json $OUT/bench_fsdp.json
"""FSDP2 with the optimizer state offloaded, against the alternatives, at the same numerics:
the GPT of ``models_torch.py`` (bf16 matmuls through FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 sharded parameters
and fp32 AdamW state in every setup), one process per GPU (torchrun), any world size
(1 included).

Setups (``--setups``, comma-separated):
  fsdp_gpu          FSDP2, torch.optim.AdamW(fused=True) with its state in GPU memory
  fsdp_cpu_offload  FSDP2 with CPUOffloadPolicy (sharded params, grads and the state on the
                    host; torch.optim.AdamW(fused=True) on the CPU) (CUDA only)
  ts_cpu            FSDP2 + OffloadAdamW(mode="cpu"): each rank's shard's state on the host
  ts_hybrid         FSDP2 + OffloadAdamW(mode="hybrid") (CUDA only)
  ds_zero2_offload  DeepSpeed ZeRO-2, offload_optimizer=cpu (DeepSpeedCPUAdam), bf16; no FSDP
                    (CUDA only; skipped where DeepSpeed is not installed)
A setup may end in ``~clip`` (clip to global norm 1.0: TrainStream ``max_grad_norm``, the
others ``clip_grad_norm_`` / DeepSpeed's ``gradient_clipping``) and, for TrainStream, in
``@N`` (N worker threads per rank) or ``~cores`` (``worker_cores="auto"``).

Per setup (rank 0 prints a table, ``--json`` saves it): step time (median of ``--steps``
steps after ``--warmup``, each ended by a device synchronize and a barrier), tokens/s over
all ranks, peak GPU memory (max over ranks), host memory (resident set summed over ranks,
growth from before the setup was built; TrainStream's host state and pinned bytes from
``stats()``, summed).

``--device cpu`` runs the CPU-capable setups over gloo with a tiny model (a smoke test of
the script: ``python experiments/bench_fsdp.py --device cpu --size micro``, or torchrun
with 2 processes); the figures mean nothing there.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SIZES  # noqa: E402
from models_torch import GPT  # noqa: E402

SETUPS = ("fsdp_gpu", "fsdp_cpu_offload", "ts_cpu", "ts_hybrid", "ds_zero2_offload")
CUDA_ONLY = ("fsdp_cpu_offload", "ts_hybrid", "ds_zero2_offload")
HP = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _init(device: str) -> tuple[int, int, torch.device]:
    """Join torchrun's process group (or make one of a single process)."""
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    dev = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def _rss() -> int:
    """This process's resident set, bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def build(setup: str, args, device: torch.device):
    """``(model, step(x) -> None, optimizer or None)`` of one setup."""
    name, *opts = setup.split("~")
    name, _, threads = name.partition("@")
    clip = 1.0 if "clip" in opts else None
    layers, d, heads = SIZES.get(args.size, (2, 64, 2))  # "micro": a smoke-test size
    torch.manual_seed(0)
    model = GPT(layers, d, heads, vocab=args.vocab, ctx=args.seq).to(device)
    if name == "ds_zero2_offload":
        from bench_train import deepspeed_engine  # noqa: PLC0415

        engine = deepspeed_engine(model, args.batch, clip)

        def ds_step(x):
            loss = F.cross_entropy(engine(x).float().flatten(0, 1), x.flatten())
            engine.backward(loss)
            engine.step()

        return engine, ds_step, None
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    kw = {}
    if device.type == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if name == "fsdp_cpu_offload":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    params = list(model.parameters())
    user_clip = clip
    if name.startswith("ts_"):
        from trainstream.torch import OffloadAdamW  # noqa: PLC0415

        opt = OffloadAdamW(params, mode=name[3:], threads=int(threads) if threads else None, max_grad_norm=clip,
                           worker_cores="auto" if "cores" in opts else None, **HP)
        user_clip = None
    elif name in ("fsdp_gpu", "fsdp_cpu_offload"):
        opt = torch.optim.AdamW(params, fused=True, **HP)
    else:
        raise ValueError(f"unknown setup {setup!r}; expected one of {SETUPS}")

    def fsdp_step(x):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        loss.backward()
        if user_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, user_clip)
        opt.step()
        opt.zero_grad()

    return model, fsdp_step, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def run(setup: str, args, rank: int, world: int, device: torch.device) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base_gpu = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    rss0 = _rss()
    model, step, opt = build(setup, args, device)
    n_params = sum(p.numel() for p in model.parameters())  # DTensors: the global count
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step(x)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    mine = {"rss_growth": _rss() - rss0,
            "gpu_peak": (torch.cuda.max_memory_allocated(device) - base_gpu) if device.type == "cuda" else 0}
    if opt is not None and hasattr(opt, "stats"):
        st = opt.stats()
        mine.update(host_state=st.get("host_state_bytes", 0.0), pinned=st.get("pinned_state_bytes", 0.0),
                    threads=st.get("threads", 0.0))
        opt.close()
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    del model, step, opt
    med = statistics.median(times)
    row = {"setup": setup, "size": args.size, "params_M": n_params / 1e6, "world_size": world,
           "batch_per_rank": args.batch, "seq": args.seq, "step_ms_median": 1e3 * med, "step_ms_min": 1e3 * min(times),
           "tokens_per_s": world * args.batch * args.seq / med,
           "gpu_peak_gib_max": max(e["gpu_peak"] for e in every) / 2**30,
           "host_rss_growth_gib_sum": sum(e["rss_growth"] for e in every) / 2**30}
    if "host_state" in mine:
        row.update(host_state_gib_sum=sum(e["host_state"] for e in every) / 2**30,
                   pinned_gib_sum=sum(e["pinned"] for e in every) / 2**30,
                   threads_per_rank=[e["threads"] for e in every])
    return row


def _table(rows: list[dict]) -> str:
    cols = ("setup", "step_ms_median", "tokens_per_s", "gpu_peak_gib_max", "host_rss_growth_gib_sum",
            "host_state_gib_sum", "pinned_gib_sum")
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r.get(c, "") if isinstance(r.get(c), str) else (f"{r[c]:.3f}" if c in r else "-") for c in cols]
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default="fsdp_gpu,fsdp_cpu_offload,ts_cpu,ts_hybrid,ds_zero2_offload")
    ap.add_argument("--size", default="350m", choices=[*SIZES, "micro"])
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rank, world, device = _init(args.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    rows = []
    try:
        for setup in [s for s in args.setups.split(",") if s]:
            name = setup.split("~")[0].split("@")[0]
            if device.type != "cuda" and name in CUDA_ONLY:
                rows.append({"setup": setup, "skipped": "needs CUDA"})
            elif name == "ds_zero2_offload" and importlib.util.find_spec("deepspeed") is None:
                rows.append({"setup": setup, "skipped": "DeepSpeed is not installed"})
            else:
                rows.append(run(setup, args, rank, world, device))
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
        result = {"world_size": world, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "rows": rows}
        if rank == 0:
            print(_table([r for r in rows if "skipped" not in r]))
            for r in rows:
                if "skipped" in r:
                    print(f"{r['setup']}: skipped ({r['skipped']})")
            if args.json:
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
        return result
    finally:
        gc.collect()  # FSDP2's modules, collected after the group is gone, aborted the exit (torch 2.13, gloo)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
