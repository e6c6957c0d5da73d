# Run (GPU machine): python experiments/bench_train.py --configs 125m:8,350m:8,1.3b:8,1.3b:24 --json $OUT/bench_train.json
"""End-to-end training benchmark: GPT-style models (125M to 20B, ``SIZES``; bf16 matmuls)
on batches of B x 1024 tokens, every optimizer placement at the same numerics; per setup
step time, tokens/s, MFU, peak GPU memory and peak host memory.

Sizes where offloading is needed (issue #22): ``3b`` (3.10B), ``5b``, ``7b`` (6.65B),
``8b``, ``9b``, ``10b``, ``13b``, ``20b``; models are created directly on the device in
their dtype (a 7B bf16 model takes ~2 s, no host copy of its weights). ``--ckpt``
checkpoints the activations of every block, in every setup alike (24 x 1024 tokens at
3B-7B need it). ``--lean`` keeps only the timed steps (no phase-memory step, forward
probe or back-to-back steps: each is a multi-second step at 7B).

Each setup runs in a fresh subprocess (``--same-process``: all in this one, as before),
with ``--timeout`` seconds and within ``--budget`` seconds for the whole run; the JSON is
rewritten after every setup and a one-line summary printed. Host memory per setup: the
drop of the machine's ``MemAvailable`` below its value before the subprocess started,
sampled every 0.1 s by the parent (``host_used_peak_gib``: pinned memory, page tables and
everything the setup allocated; other processes' changes included), the subprocess's own
resident high-water mark (``host.VmHWM_gib``, ``host.ru_maxrss_gib``) and, for
TrainStream, ``host_state_gib`` / ``pinned_state_gib`` from ``stats()``. A setup that
drives ``MemAvailable`` below ``--host-reserve-gib`` is killed and recorded as a host OOM
(so is a SIGKILL from the kernel's OOM killer); ``torch.OutOfMemoryError`` as a GPU OOM.
MFU = 6 x N x tokens per step / step time / 989e12 (N: all parameters, embeddings
included; 989 TFLOP/s: H200 bf16 dense peak, ``--peak-tflops``; attention's
sequence-quadratic FLOPs and checkpointing's recomputation not counted).

``--largest SETUPS --sizes ... --batch B [--first SIZE]``: per setup, the largest of the
sizes that completes ``--steps`` steps after ``--warmup`` at batch B, by bisection over the
sizes (each try a subprocess; an OOM of GPU or host, or a timeout, is "does not fit").
``--prebuild-ds`` compiles DeepSpeed's cpu_adam extension in the background from the start
(about a minute on a fresh machine); the setups other than bf16_fused/amp_fused wait for it.
``--device cpu`` is a smoke test of the script on the CPU (CUDA-only setups skipped):
``python experiments/bench_train.py --device cpu --configs tiny:2 --seq 64 --vocab 512 --steps 2 --warmup 1 --lean``.

Setups:
  amp_fused        fp32 weights + bf16 autocast + torch.optim.AdamW(fused=True) in GPU memory
  bf16_fused       bf16 weights + torch.optim.AdamW(fused=True) in GPU memory
  ts_cpu           bf16 weights, OffloadAdamW mode="cpu" (fp32 master + moments on the host)
  ts_cpu_eager     the same, update started during backward (last_micro_batch)
  ts_gpu           bf16 weights, OffloadAdamW mode="gpu" (zero-copy kernel)
  ts_gpu_eager     the same, each kernel launched during backward as its gradient is ready
  ts_hybrid        bf16 weights, OffloadAdamW mode="hybrid" (gpu_share of the elements by
                   the zero-copy kernel, the rest on the host; ~shareF sets it, default: OffloadAdamW's)
  ts_hybrid_eager  the same, both shares started during backward (~last: the GPU share is
                   the last parameters, gpu_params="last")
  torchao_fp32     fp32 weights + autocast + torchao CPUOffloadOptimizer (fp32 host state:
                   our numerics)
  torchao_bf16     bf16 weights + torchao CPUOffloadOptimizer (its recommended bf16 setup)
  ds_zero_offload  DeepSpeed ZeRO-2 with offload_optimizer=cpu (DeepSpeedCPUAdam), bf16
A setup may end in @N or @N:C (TrainStream: N host threads, chunks of C elements) and in
~options: ~niceN (TrainStream workers at nice N: OffloadAdamW(worker_nice=N), default 5),
~clipX (clip gradients to global norm X: TrainStream max_grad_norm=X, in-GPU setups
clip_grad_norm_; not for torchao/DeepSpeed), ~swiU (sys.setswitchinterval of U microseconds
while this setup runs; Python's default is 5000), ~last (hybrid: gpu_params="last"),
~shareF (hybrid: gpu_share=F), ~resG (TrainStream: gpu_state_bytes of G GiB: the state of the
first parameters that fit kept in GPU memory and updated there, the rest as the mode says),
~auto (TrainStream: gpu_state_bytes="auto": what fits in the GPU memory free after the first step),
~zc / ~staged (gpu / hybrid: the update kernels read the host-memory state over PCIe,
zero-copy / through the staging ring: the A/B of the staged update), ~ebN (eager zero-copy kernels capped at N blocks: OffloadAdamW(eager_blocks=N); default: a
quarter of the multiprocessors' count),
~overlap (TrainStream: OffloadAdamW(overlap_forward=model), the next forward overlaps the
update, each module waiting for its own weights; default: step() makes the current stream
wait for every new weight), ~userclipX (clip with the loop's own clip_grad_norm_(params, X)
before step(), as transformers' Trainer does; TrainStream then copies every gradient to
the host again at step()), ~base (TrainStream from the tree in .base_tree/trainstream_base,
an earlier commit for a same-process A/B: ``git archive COMMIT trainstream | tar -x -C
.base_tree && mv .base_tree/trainstream .base_tree/trainstream_base`` and rename its
``resources.files("trainstream")``; trees before 2026-12-02 gate each module's forward on
its own weights, as ~overlap does). Default against opt-in, same run:
``--setups ts_cpu,ts_cpu~overlap,ts_cpu_eager,ts_cpu_eager~overlap,ts_hybrid,ts_hybrid~overlap``
at ``--configs 350m:8,1.3b:24``; compare "stream" (back to back), not "step ms" (its
device-wide synchronize waits for the whole update in the default, for none of the
host uploads still to be queued with ~overlap).
``--trace SETUPS`` records two more steps of those setups with the engine's host timeline
(experiments/_trace_report.py): a Chrome trace file per setup in --trace-dir and a summary per
phase (worker utilisation, waits in jobs, wait_ready stalls, gradient-hook latency).

Per row: "step ms" is the median of steps each ended by a device-wide synchronize;
"stream" is the mean of --stream-steps steps run back to back, as a training loop runs,
with one drain (optimizer synchronize + device synchronize) at the end, counted. The
synchronize also waits for work on the optimizer's own streams that a loop without it
would overlap with the next forward (hybrid's GPU share kernels, queued at step()); the
final drain divided by the step count biases "stream" upwards (an upper bound).
"exposed" = step ms - bf16_fused step ms of the same config (the optimizer
time that did not hide behind compute); for TrainStream also the host update's wall time
per step (engine stats: from step() to the last upload) and the summed worker CPU time.
The last table extrapolates the largest model each setup fits in GPU memory from the
peak memory of the measured sizes (a linear fit in the parameter count, per batch).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import os
import re
import time

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling _trace_report
import _trace_report as _trace  # noqa: E402

SIZES = {  # (layers, d_model, heads); parameters with the default vocabulary and context
    "tiny": (2, 256, 4),  # 14.7M (12.9M of them the embedding)
    "125m": (12, 768, 12),  # 124.5M
    "350m": (24, 1024, 16),  # 354.9M
    "1.3b": (24, 2048, 16),  # 1.314B
    "3b": (26, 3072, 24),  # 3.103B (d 3072, head 128)
    "5b": (24, 4096, 32),  # 5.043B
    "7b": (32, 4096, 32),  # 6.654B (GPT-3 6.7B / LLaMA-7B width and depth)
    "8b": (38, 4096, 32),  # 7.863B
    "9b": (44, 4096, 32),  # 9.071B
    "10b": (32, 5120, 40),  # 10.33B
    "13b": (40, 5120, 40),  # 12.85B (GPT-3 13B width and depth)
    "20b": (44, 6144, 48),  # 20.25B
}
VOCAB = 50304
H200_BF16_DENSE_FLOPS = 989e12  # H200 SXM, bf16 tensor cores, dense (no sparsity)


def param_count(size: str, vocab: int = VOCAB, ctx: int = 1024) -> int:
    """Parameters of ``GPT(*SIZES[size])`` (tied head), without building it."""
    layers, d, _ = SIZES[size]
    return layers * (12 * d * d + 13 * d) + vocab * d + ctx * d + 2 * d


class Block(nn.Module):
    def __init__(self, d, heads, **factory):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, **factory)
        self.qkv = nn.Linear(d, 3 * d, **factory)
        self.proj = nn.Linear(d, d, **factory)
        self.ln2 = nn.LayerNorm(d, **factory)
        self.fc = nn.Linear(d, 4 * d, **factory)
        self.out = nn.Linear(4 * d, d, **factory)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-shaped decoder. ``device``/``dtype``: where and in which type the parameters
    are created and initialised (a 7B model directly on the GPU in bf16, no host copy);
    ``ckpt``: activation checkpointing of every block (recomputed in backward)."""

    def __init__(self, layers, d, heads, vocab=VOCAB, ctx=1024, device=None, dtype=None, ckpt=False):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.ckpt = ckpt
        self.wte = nn.Embedding(vocab, d, **factory)
        self.wpe = nn.Embedding(ctx, d, **factory)
        self.blocks = nn.ModuleList(Block(d, heads, **factory) for _ in range(layers))
        self.ln = nn.LayerNorm(d, **factory)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            if self.ckpt and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return F.linear(self.ln(x), self.wte.weight)  # tied head, as GPT-2


def _deepspeed_engine(model, batch, lr):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed  # noqa: PLC0415

    cfg = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": lr["lr"], "betas": list(lr["betas"]),
                                                  "weight_decay": lr["weight_decay"]}},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def build(setup, size, device, batch=8, ckpt=False, vocab=VOCAB, seq=1024):
    """``setup`` may end in ``@N`` or ``@N:C``: N host threads, chunks of C elements; and
    in ``~options`` (module docstring). The model is created on ``device`` in its dtype
    (fp32 for amp_fused and torchao_fp32, else bf16)."""
    setup, *opts_ = setup.split("~")
    sys.setswitchinterval(next((int(o[3:]) * 1e-6 for o in opts_ if o.startswith("swi")), 0.005))
    clip = next((float(o[4:]) for o in opts_ if o.startswith("clip")), None)
    user_clip = next((float(o[8:]) for o in opts_ if o.startswith("userclip")), None)
    if clip is not None and setup.split("@")[0].endswith("_eager"):
        raise ValueError(f"{setup}: the eager path is off with clipping (use the setup without _eager)")
    setup, _, opts = setup.partition("@")
    threads, _, chunk = opts.partition(":")
    threads = int(threads) if threads else None
    chunk = int(chunk) if chunk else 1 << 20
    layers, d, heads = SIZES[size]
    torch.manual_seed(0)
    # DeepSpeed's bf16 engine keeps the fp32 master on the host and bf16 weights on the GPU,
    # as the bf16 TrainStream setups: created in bf16 (DeepSpeed would cast an fp32 model).
    dtype = torch.float32 if setup in ("amp_fused", "torchao_fp32") else torch.bfloat16
    model = GPT(layers, d, heads, vocab=vocab, ctx=max(seq, 1024), device=device, dtype=dtype, ckpt=ckpt)
    params = list(model.parameters())
    lr = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    autocast = setup in ("amp_fused", "torchao_fp32")
    eager = False
    if setup in ("amp_fused", "bf16_fused"):
        opt = torch.optim.AdamW(params, fused=True, **lr)
    elif setup.startswith("ts_"):
        if "base" in opts_:  # the earlier tree, for a same-process A/B (see the docstring)
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".base_tree"))
            from trainstream_base.torch import OffloadAdamW
        else:
            from trainstream.torch import OffloadAdamW

        mode = "gpu" if setup.startswith("ts_gpu") else ("hybrid" if setup.startswith("ts_hybrid") else "cpu")
        extra = {"worker_nice": next((int(o[4:]) for o in opts_ if o.startswith("nice")), 5)}
        eager_blocks = next((int(o[2:]) for o in opts_ if o.startswith("eb")), None)
        if eager_blocks is not None:
            extra["eager_blocks"] = eager_blocks
        resident = next((float(o[3:]) for o in opts_ if o.startswith("res")), None)
        if resident is not None:  # ~resG: gpu_state_bytes of G GiB
            extra["gpu_state_bytes"] = int(resident * 2**30)
        if "auto" in opts_:  # ~auto: gpu_state_bytes="auto"
            extra["gpu_state_bytes"] = "auto"
        if mode == "hybrid":
            share = next((float(o[5:]) for o in opts_ if o.startswith("share")), None)
            if share is not None:
                extra["gpu_share"] = share
            if "last" in opts_:
                extra["gpu_params"] = "last"
        if "overlap" in opts_:
            extra["overlap_forward"] = model
        opt = OffloadAdamW(params, mode=mode, threads=threads, chunk_size=chunk, max_grad_norm=clip, **extra, **lr)
        if "zc" in opts_ or "staged" in opts_:  # A/B: over PCIe (zero-copy) / through the staging ring
            opt._engine.device.staged = "staged" in opts_
        eager = setup.endswith("_eager")
    elif clip is not None:
        raise ValueError(f"~clip is not implemented for {setup}")
    elif setup == "ds_zero_offload":
        model = _deepspeed_engine(model, batch, lr)
        opt = None
    elif setup in ("torchao_fp32", "torchao_bf16"):
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **lr)
    else:
        raise ValueError(f"unknown setup {setup!r}")
    # In-GPU baselines clip with clip_grad_norm_ before the step; TrainStream clips inside.
    clip_fn = (lambda: torch.nn.utils.clip_grad_norm_(params, clip)) if clip is not None and not setup.startswith("ts_") else None
    if user_clip is not None:
        clip_fn = lambda: torch.nn.utils.clip_grad_norm_(params, user_clip)  # noqa: E731
    return model, opt, autocast, eager, clip_fn


def gpu_timeline(prof, steps: int) -> dict:
    """Where the GPU idled during a profiled run: the union of kernel intervals (all
    streams; copies excluded) against the span from the first to the last kernel, and
    the largest idle gaps with the kernel that ended each (ms from the span's start)."""
    kernels = []
    copies = {"HtoD": [], "DtoH": []}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if name.startswith(("Memcpy", "Memset", "cudaMemcpy")) or "memcpy" in name.lower():
            for way in copies:
                if way in name:
                    copies[way].append((e.time_range.start, e.time_range.end))
            continue
        kernels.append((e.time_range.start, e.time_range.end, name))
    copy_busy = {}
    for way, iv in copies.items():  # union of the copy intervals of one direction
        iv.sort()
        busy, cur = 0.0, None
        for a, b in iv:
            if cur is None or a > cur[1]:
                busy += (cur[1] - cur[0]) if cur else 0.0
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        busy += (cur[1] - cur[0]) if cur else 0.0
        copy_busy[f"memcpy_{way}_busy_ms_per_step"] = busy / 1e3 / steps
    if not kernels:
        return {}
    kernels.sort()
    t0, busy, gaps = kernels[0][0], 0.0, []
    cur_s, cur_e, cur_name = kernels[0]
    for s0, e0, name in kernels[1:]:
        if s0 > cur_e:
            busy += cur_e - cur_s
            gaps.append((s0 - cur_e, (cur_e - t0) / 1e3, cur_name[:60], name[:60]))
            cur_s, cur_e, cur_name = s0, e0, name
        elif e0 > cur_e:
            cur_e, cur_name = e0, name
    busy += cur_e - cur_s
    span = cur_e - t0
    gaps.sort(reverse=True)
    return {
        "span_ms_per_step": span / 1e3 / steps,
        "kernel_busy_ms_per_step": busy / 1e3 / steps,
        "idle_ms_per_step": (span - busy) / 1e3 / steps,
        "largest_gaps": [{"ms": g / 1e3, "at_ms": at, "after": a, "before": b} for g, at, a, b in gaps[:8]],
        **copy_busy,
    }


class _Dev:
    """The few device calls of :func:`run`, no-ops on the CPU (``--device cpu``: a smoke test)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self):
        return torch.cuda.memory_allocated() if self.cuda else 0

    def max_allocated(self):
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def empty_cache(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def host_memory_self() -> dict:
    """This process's host memory, GiB: the resident high-water mark (``ru_maxrss``; and
    ``VmHWM``), the resident and locked sizes now (``VmRSS``, ``VmLck``, ``VmPin``)."""
    import resource  # noqa: PLC0415

    out = {"ru_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmHWM", "VmRSS", "VmLck", "VmPin"):
                    out[f"{key}_gib"] = int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return out


def run(setup, size, batch, seq, steps, warmup, device, profile=False, trace_dir=None, stream_steps=0,
        ckpt=False, lean=False, vocab=VOCAB, peak_flops=H200_BF16_DENSE_FLOPS):
    """Build ``setup`` at ``size``, time ``steps`` steps after ``warmup``, return its row.

    ``lean``: no per-phase memory step, no forward probe (the big configs: each costs a
    step). MFU = 6 * N * tokens per step / step time / ``peak_flops`` (N: all parameters,
    embeddings included; attention's sequence-quadratic FLOPs and the recomputation of
    activation checkpointing not counted: model FLOPs utilisation as in PaLM, appendix B).
    """
    dev = _Dev(device)
    # What an earlier setup left allocated (torchao's optimizer, measured on the H200
    # machine, keeps its fp32 model alive after it is deleted): subtracted from the peak.
    dev.empty_cache()
    base = dev.allocated()
    host0 = host_memory_self()
    t_build = time.perf_counter()
    model, opt, autocast, eager, clip_fn = build(setup, size, device, batch, ckpt=ckpt, vocab=vocab, seq=seq)
    dev.sync()
    build_s = time.perf_counter() - t_build
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq), device=device, generator=g)
    times = []
    first_step_s = None
    dev.reset_peak()
    stats0 = None

    def one_step():
        with _trace.span("forward"):
            with torch.autocast(dev.device.type, torch.bfloat16, enabled=autocast):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        if opt is None:  # DeepSpeed engine
            model.backward(loss)
            model.step()
        else:
            with _trace.span("backward"):
                if eager:
                    with opt.last_micro_batch():
                        loss.backward()
                else:
                    loss.backward()
            with _trace.span("step"):
                if clip_fn is not None:
                    clip_fn()
                opt.step()
                opt.zero_grad()

    for i in range(warmup + steps):
        if i == warmup and hasattr(opt, "stats"):
            stats0 = opt.stats()
        dev.sync()
        t0 = time.perf_counter()
        one_step()
        # The next step's forward waits per layer; time to the point where the next
        # iteration could start (CPU offload steps finish asynchronously).
        dev.sync()
        t1 = time.perf_counter()
        if i == 0:
            first_step_s = t1 - t0
        if i >= warmup:
            times.append(t1 - t0)
    peak_timed = dev.max_allocated()  # the phase probe resets the counter
    mem_phases = None
    if not lean:
        # One more step, the memory of each phase: allocated at its end and the peak within it
        # (net of what earlier setups left): what the peak is made of (issue #6's B/param).
        phases = {}
        dev.sync()
        dev.reset_peak()
        with torch.autocast(dev.device.type, torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        del logits
        dev.sync()
        phases["forward"] = (dev.allocated() - base, dev.max_allocated() - base)
        dev.reset_peak()
        if opt is None:
            model.backward(loss)
        elif eager:
            with opt.last_micro_batch():
                loss.backward()
        else:
            loss.backward()
        del loss
        dev.sync()
        phases["backward"] = (dev.allocated() - base, dev.max_allocated() - base)
        dev.reset_peak()
        if opt is None:
            model.step()
        else:
            if clip_fn is not None:
                clip_fn()
            opt.step()
            opt.zero_grad()
        dev.sync()
        phases["step"] = (dev.allocated() - base, dev.max_allocated() - base)
        mem_phases = {k: {"end_gib": a / 2**30, "peak_gib": b / 2**30} for k, (a, b) in phases.items()}
    stream_ms = None
    if stream_steps and not lean:
        # Back to back, as a training loop runs: no device-wide synchronize between steps
        # (which also waits for work of the optimizer's own streams that the next forward
        # would overlap, e.g. hybrid's GPU share). One drain at the end, counted.
        dev.sync()
        t0 = time.perf_counter()
        for _ in range(stream_steps):
            one_step()
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        dev.sync()
        stream_ms = 1e3 * (time.perf_counter() - t0) / stream_steps
    fwd_ms = None
    if not lean and not setup.split("~")[0].split("@")[0].startswith(("ts_", "torchao", "ds_")):
        # The forward alone (with autograd's graph, then dropped), for the clipping target
        # of issue #6: in-GPU step + max(0, host update - next forward) + 5%.
        fwd = []
        for _ in range(3):
            dev.sync()
            t0 = time.perf_counter()
            with torch.autocast(dev.device.type, torch.bfloat16, enabled=autocast):
                logits = model(x)
            F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
            dev.sync()
            fwd.append(time.perf_counter() - t0)
            del logits
        fwd_ms = 1e3 * statistics.median(fwd)
    trace = None
    if trace_dir is not None:
        try:
            _trace.start()  # until stop(): the engine's methods wrapped to record spans
            for _ in range(2):
                with _trace.span("sync"):
                    dev.sync()
                one_step()
            with _trace.span("sync"):
                dev.sync()
            if hasattr(opt, "synchronize"):
                opt.synchronize()
        finally:
            spans = _trace.stop()
        os.makedirs(trace_dir, exist_ok=True)
        with open(os.path.join(trace_dir, "trace_" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{size}x{batch}_{setup}") + ".json"), "w") as f:
            json.dump(_trace.chrome_trace(spans), f)
        trace = _trace.summary(spans, phases=("forward", "backward", "step", "sync"))
    timeline = None
    if profile and dev.cuda:
        from torch.profiler import ProfilerActivity, profile as torch_profile  # noqa: PLC0415

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                one_step()
            torch.cuda.synchronize()
        timeline = gpu_timeline(prof, 3)
    # Let asynchronous work drain (not timed) and take the peak.
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    dev.sync()
    peak = (max(peak_timed, dev.max_allocated()) - base) / 2**30
    extra = {}
    if dev.cuda:
        extra["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        extra["gpu_total_gib"] = torch.cuda.get_device_properties(dev.device).total_memory / 2**30
        extra["device"] = torch.cuda.get_device_name(dev.device)
    if hasattr(opt, "stats"):
        st = opt.stats()
        peak += st.get("gpu_state_bytes", 0.0) / 2**30  # ~res: GPU memory outside torch's allocator
        extra["threads"] = st.get("threads", 0.0)
        extra["host_update_wall_ms_last"] = st.get("last_step_wall_ms", 0.0)
        extra["gpu_state_params"] = st.get("gpu_state_params", 0.0)
        for k in ("host_state_bytes", "pinned_state_bytes", "pageable_state_bytes", "gpu_state_bytes"):
            if k in st:
                extra[k.replace("_bytes", "_gib")] = st[k] / 2**30
        if stats0 is not None:
            # Per optimizer step since stats0: the timed steps and the memory, stream,
            # trace and profile steps after them (dividing by --steps alone overstated
            # both figures by the count of those extra steps).
            n = max(st["steps"] - stats0["steps"], 1.0)
            extra["worker_update_cpu_ms_per_step"] = (st["update_ms_total"] - stats0["update_ms_total"]) / n
            extra["ready_stall_ms_per_step"] = (st["ready_stall_ms_total"] - stats0["ready_stall_ms_total"]) / n
    host = host_memory_self()  # before the teardown: the state is still there
    host["rss_before_build_gib"] = host0.get("VmRSS_gib", 0.0)
    if hasattr(opt, "close"):
        opt.close()
    del model, opt
    dev.empty_cache()
    med = statistics.median(times)
    tokens = batch * seq
    return {
        "setup": setup,
        "size": size,
        "params_M": n_params / 1e6,
        "batch": batch,
        "seq": seq,
        "ckpt": ckpt,
        "step_ms_median": 1e3 * med,
        "step_ms_min": 1e3 * min(times),
        "steps_timed": len(times),
        **({"step_ms_stream": stream_ms} if stream_ms is not None else {}),
        **({"mem_phases": mem_phases} if mem_phases is not None else {}),
        "tokens_per_s": tokens / med,
        "mfu": 6 * n_params * tokens / med / peak_flops,
        "peak_gib": peak,
        "left_by_earlier_setups_gib": base / 2**30,
        "host": host,
        "build_s": build_s,
        "first_step_s": first_step_s,
        **({"forward_ms": fwd_ms} if fwd_ms is not None else {}),
        **extra,
        **({"gpu_timeline": timeline} if timeline else {}),
        **({"host_trace": trace} if trace else {}),
    }


def largest_models(rows, capacity_gib):
    """Per (setup, batch): the parameter count at which the linear fit of peak memory in
    the parameter count reaches ``capacity_gib`` (needs two measured sizes)."""
    out = {}
    groups: dict = {}
    for r in rows:
        if "step_ms_median" in r and r.get("purpose", "bench") == "bench":
            groups.setdefault((r["setup"], r["batch"]), []).append((r["params_M"], r["peak_gib"]))
    for key, pts in groups.items():
        by_size: dict = {}  # a setup run twice at one size: the larger peak
        for x, y in pts:
            by_size[x] = max(y, by_size.get(x, y))
        pts = sorted(by_size.items())
        if len(pts) < 2:
            continue
        (x0, y0), (x1, y1) = pts[0], pts[-1]
        slope = (y1 - y0) / (x1 - x0)
        if slope > 0:
            out[f"{key[0]} @ batch {key[1]}"] = {"params_B": (x0 + (capacity_gib - y0) / slope) / 1e3,
                                                 "gib_per_B_params": slope * 1e3}
    return out


IN_GPU = ("bf16_fused", "amp_fused")
CUDA_ONLY = ("ts_gpu", "ts_hybrid", "torchao", "ds_")


def _base_name(setup: str) -> str:
    return setup.split("~")[0].split("@")[0]


def _failure_kind(exc: BaseException) -> str:
    """``gpu_oom``, ``host_oom`` or ``error`` for an exception a setup raised."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or re.search(r"host memory|pinned|cudaHostAlloc|cudaHostRegister|"
                                                 r"Cannot allocate memory|std::bad_alloc", text, re.I):
        return "host_oom"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return "gpu_oom"
    return "error"


def child_main(spec: dict) -> None:
    """One setup in this fresh process (``--_child``): its row, or its failure, to ``spec["out"]``."""
    try:  # a host OOM must kill this process, not the benchmark's parent or anything else
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    # DeepSpeed's one-process group: a port of this process (the previous setup's may linger)
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 2000))
    t0 = time.perf_counter()
    if spec["device"] == "cuda":
        torch.zeros(1, device="cuda")  # the context, outside the setup's timings
    init_s = time.perf_counter() - t0
    try:
        row = run(spec["setup"], spec["size"], spec["batch"], spec["seq"], spec["steps"], spec["warmup"],
                  torch.device(spec["device"]), spec["profile"], spec["trace_dir"], spec["stream_steps"],
                  ckpt=spec["ckpt"], lean=spec["lean"], vocab=spec["vocab"], peak_flops=spec["peak_flops"])
    except BaseException as exc:  # noqa: BLE001 - the row says what failed
        row = {"setup": spec["setup"], "size": spec["size"], "batch": spec["batch"],
               "error": f"{type(exc).__name__}: {exc}"[:600], "failure": _failure_kind(exc), "host": host_memory_self()}
    row["context_init_s"] = init_s
    with open(spec["out"], "w") as f:
        json.dump(row, f)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_isolated(spec: dict, timeout: float, log_path: str, reserve_gib: float) -> dict:
    """``spec`` in a fresh subprocess (its own session) with ``timeout`` seconds; the parent
    samples the host every 0.1 s: ``MemAvailable`` (its drop from before the child is the
    setup's host memory, pinned memory and other processes' included) and the child's
    ``VmRSS``. Below ``reserve_gib`` of ``MemAvailable`` the child is killed (a host OOM
    recorded as such, before the kernel's OOM killer picks a process). Returns the row."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    if os.path.exists(spec["out"]):
        os.remove(spec["out"])
    avail0 = _meminfo_available()
    min_avail, rss_peak, killed = avail0, 0, None
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            time.sleep(0.1)
            avail = _meminfo_available()
            if avail is not None:
                min_avail = min(min_avail, avail)
            rss_peak = max(rss_peak, _rss(proc.pid))
            if avail is not None and avail < reserve_gib * 2**30:
                killed = f"host_oom: MemAvailable {avail / 2**30:.1f} GiB < {reserve_gib} GiB, killed by the benchmark"
            elif time.perf_counter() - t0 > timeout:
                killed = f"timeout: still running after {timeout:.0f} s, killed"
            if killed:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    wall = time.perf_counter() - t0
    row = None
    if killed is None and os.path.exists(spec["out"]):
        with open(spec["out"]) as f:
            row = json.load(f)
    if row is None:
        rc = proc.returncode
        if killed:
            kind, why = killed.split(":")[0], killed
        elif rc == -9:
            kind, why = "host_oom", "SIGKILL from outside (the kernel's OOM killer, most likely)"
        elif rc is not None and rc < 0:
            kind, why = "crash", f"killed by signal {-rc}"
        else:
            kind, why = "crash", f"exited with {rc} without a row"
        with open(log_path, errors="replace") as f:
            tail = f.read()[-1500:]
        row = {"setup": spec["setup"], "size": spec["size"], "batch": spec["batch"], "error": why,
               "failure": kind, "returncode": rc, "log_tail": tail}
    row["wall_s"] = wall
    row["log"] = log_path
    if avail0 is not None:
        row["host_used_peak_gib"] = (avail0 - min_avail) / 2**30  # the machine's, above the start
    row["rss_peak_sampled_gib"] = rss_peak / 2**30
    return row


def one_line(r: dict, elapsed: float) -> str:
    """The row as one line: time, throughput, MFU, memory, or why it has none."""
    cfg = f"{r['size']} x{r['batch']}"
    head = f"[{elapsed:6.0f} s] {cfg:9s} {r['setup']:18s}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if "step_ms_median" not in r:
        fits = "DOES NOT FIT" if r.get("failure") in ("gpu_oom", "host_oom") else "FAILED"
        return (f"{head} {fits} ({r.get('failure')}): {r.get('error', '')[:160]}"
                f" [wall {r.get('wall_s', 0):.0f} s, host +{r.get('host_used_peak_gib', 0):.1f} GiB]")
    h = r.get("host", {})
    pinned = f", pinned state {r['pinned_state_gib']:.1f}" if "pinned_state_gib" in r else ""
    return (f"{head} {r['step_ms_median']:9.1f} ms {r['tokens_per_s']:9.0f} tok/s MFU {100 * r['mfu']:5.1f}% | "
            f"GPU peak {r['peak_gib']:6.2f} GiB | host +{r.get('host_used_peak_gib', float('nan')):.1f} GiB "
            f"(RSS HWM {h.get('VmHWM_gib', h.get('ru_maxrss_gib', float('nan'))):.1f}{pinned}) | "
            f"build {r['build_s']:.1f} s, 1st step {r['first_step_s']:.1f} s, wall {r.get('wall_s', float('nan')):.0f} s")


def search_largest(setup: str, sizes: list, first: str | None, runner) -> dict:
    """The largest of ``sizes`` (ordered by parameters) that ``setup`` trains, by bisection
    (fitting assumed monotonic in the size): ``runner(size)`` returns a row; a row without
    a step time (OOM of GPU or host, timeout, crash) counts as "does not fit". ``first``:
    the size tried first (a good guess saves a try)."""
    sizes = sorted(sizes, key=param_count)
    lo, hi, tries = -1, len(sizes), []
    mid = sizes.index(first) if first in sizes else (len(sizes) - 1) // 2
    while lo + 1 < hi:
        row = runner(sizes[mid])
        fits = "step_ms_median" in row
        tries.append({"size": sizes[mid], "fits": fits, "failure": row.get("failure"),
                      "skipped": row.get("skipped")})
        if row.get("skipped"):
            break
        if fits:
            lo = mid
        else:
            hi = mid
        mid = (lo + hi) // 2
    return {"largest_fit": sizes[lo] if lo >= 0 else None,
            "largest_fit_params_B": param_count(sizes[lo]) / 1e9 if lo >= 0 else None,
            "smallest_not_fit": sizes[hi] if hi < len(sizes) else None,
            "resolved": lo + 1 >= hi, "tries": tries}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None, help="comma-separated model:batch, e.g. 125m:8,1.3b:24 "
                    "(default 350m:8 unless --largest is given)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--setups", default="bf16_fused,amp_fused,ts_cpu,ts_cpu_eager,ts_gpu,torchao_fp32,torchao_bf16,ds_zero_offload")
    ap.add_argument("--profile", default="", help="comma list of setups to profile (3 more steps): GPU idle gaps")
    ap.add_argument("--trace", default="", help="comma list of setups to trace (2 more steps): host timeline")
    ap.add_argument("--trace-dir", default=".", help="where the Chrome trace files of --trace go")
    ap.add_argument("--stream-steps", type=int, default=6,
                    help="then time this many steps back to back, one drain at the end (0: off)")
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing of every block, in every setup")
    ap.add_argument("--lean", action="store_true",
                    help="only the timed steps: no phase-memory step, forward probe or back-to-back steps")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke test of the script (CUDA-only setups skipped; figures mean nothing)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_FLOPS / 1e12,
                    help="the MFU's peak (default: H200 bf16 dense, 989)")
    ap.add_argument("--order", choices=["config", "setup"], default="config",
                    help="loop order: every setup of a config, then the next config (config), or every "
                         "config of a setup, then the next setup (setup)")
    ap.add_argument("--same-process", action="store_true",
                    help="every setup in this process (the earlier behaviour); default: one fresh subprocess each")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per setup (subprocess) before it is killed")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds for the whole run (0: none); setups that no longer fit are skipped")
    ap.add_argument("--host-reserve-gib", type=float, default=2.5,
                    help="kill a setup when the host's MemAvailable falls below this (a host OOM)")
    ap.add_argument("--prebuild-ds", action="store_true",
                    help="build DeepSpeed's cpu_adam extension in the background (nice 19) from the start; "
                         "setups other than bf16_fused/amp_fused wait for it")
    ap.add_argument("--largest", default="", help="comma list of setups: the largest of --sizes each trains "
                    "at --batch (bisection; each try a subprocess, --steps/--warmup as given, lean)")
    ap.add_argument("--sizes", default="1.3b,3b,5b,7b,10b,13b")
    ap.add_argument("--batch", type=int, default=8, help="batch of the --largest search")
    ap.add_argument("--first", default=None, help="the size the --largest search tries first")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child is not None:
        child_main(json.loads(args._child))
        return
    t_start = time.perf_counter()
    if args.configs is None:
        args.configs = "" if args.largest else "350m:8"
    for size in [c.partition(":")[0] for c in args.configs.split(",") if c] + \
            ([x for x in args.sizes.split(",") if x] if args.largest else []):
        if size not in SIZES:
            ap.error(f"unknown model size {size!r} (known: {', '.join(SIZES)})")
    if args.same_process and args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU (or --device cpu)")
    profiled = set(filter(None, args.profile.split(",")))
    traced = set(filter(None, args.trace.split(",")))
    log_dir = (args.json + ".logs") if args.json else os.path.join("/tmp", f"bench_train_{os.getpid()}")
    if not args.same_process:
        os.makedirs(log_dir, exist_ok=True)
    rows: list = []
    largest: dict = {}
    meta = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
            "host_mem_total_gib": None, "mfu": "6 * params * tokens per step / step time / peak_flops",
            "peak_flops": args.peak_tflops * 1e12}
    try:
        with open("/proc/meminfo") as f:
            meta["host_mem_total_gib"] = int(f.readline().split()[1]) * 1024 / 2**30
    except OSError:
        pass
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _common import git_commit  # noqa: PLC0415

        meta["commit"] = git_commit()
    except Exception:  # noqa: BLE001 - informational
        meta["commit"] = None

    def save():
        if not args.json:
            return
        ok = [r for r in rows if "step_ms_median" in r]
        cap = max((r.get("gpu_total_gib", 0) for r in ok), default=0)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"args": vars(args), "meta": meta, "device": next((r["device"] for r in ok if "device" in r), args.device),
                       "torch": torch.__version__, "rows": rows, "largest_measured": largest,
                       "largest_models": largest_models(rows, cap) if cap else {}}, f, indent=1)
        os.replace(tmp, args.json)

    prebuild = None
    wants_ds = any(_base_name(x).startswith("ds_") for x in args.setups.split(",") + args.largest.split(","))
    if args.prebuild_ds and wants_ds and args.device == "cuda" and not args.same_process:
        import subprocess  # noqa: PLC0415

        plog = open(os.path.join(log_dir, "prebuild_ds.log"), "w")  # noqa: SIM115 - open while it runs
        prebuild = (subprocess.Popen([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; "
                                      "CPUAdamBuilder().load()"], stdout=plog, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=lambda: os.nice(19)), time.perf_counter())
        meta["prebuild_ds"] = {"started_s": time.perf_counter() - t_start}

    def remaining():
        return args.budget - (time.perf_counter() - t_start) if args.budget else float("inf")

    def wait_prebuild():
        nonlocal prebuild
        if prebuild is None:
            return
        proc, t0 = prebuild
        try:
            proc.wait(timeout=max(1.0, min(remaining(), 900)))
        except Exception:  # noqa: BLE001 - out of budget: leave it; the DeepSpeed setup builds itself
            return
        meta["prebuild_ds"].update(returncode=proc.returncode, seconds=time.perf_counter() - t0)
        print(f"[{time.perf_counter() - t_start:6.0f} s] DeepSpeed cpu_adam prebuilt in "
              f"{time.perf_counter() - t0:.0f} s (returncode {proc.returncode})", flush=True)
        prebuild = None

    def measure(setup, size, batch, steps, warmup, lean, purpose):
        base = {"setup": setup, "size": size, "batch": batch}
        if args.device != "cuda" and _base_name(setup).startswith(CUDA_ONLY):
            return {**base, "skipped": "needs CUDA"}
        if _base_name(setup) not in IN_GPU:
            wait_prebuild()
        left = remaining()
        if left < 15:
            return {**base, "skipped": f"time budget ({args.budget:.0f} s) spent"}
        spec = {"setup": setup, "size": size, "batch": batch, "seq": args.seq, "steps": steps, "warmup": warmup,
                "device": args.device, "profile": setup in profiled,
                "trace_dir": args.trace_dir if setup in traced else None, "stream_steps": args.stream_steps,
                "ckpt": args.ckpt, "lean": lean, "vocab": args.vocab, "peak_flops": args.peak_tflops * 1e12}
        if args.same_process:
            try:
                row = run(setup, size, batch, args.seq, steps, warmup, torch.device(args.device), spec["profile"],
                          spec["trace_dir"], args.stream_steps, ckpt=args.ckpt, lean=lean, vocab=args.vocab,
                          peak_flops=spec["peak_flops"])
            except Exception as exc:  # noqa: BLE001 - report and go on with the other setups
                row = {**base, "error": f"{type(exc).__name__}: {exc}"[:400], "failure": _failure_kind(exc)}
                _Dev(args.device).empty_cache()
        else:
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{purpose}_{size}x{batch}_{setup}")
            spec["out"] = os.path.join(log_dir, name + ".row.json")
            row = run_isolated(spec, min(args.timeout, left), os.path.join(log_dir, name + ".log"),
                               args.host_reserve_gib)
        return row

    def record(row, purpose):
        row["purpose"] = purpose
        rows.append(row)
        print(one_line(row, time.perf_counter() - t_start), flush=True)
        save()
        return row

    cfgs = [(c.partition(":")[0], int(c.partition(":")[2] or 8)) for c in args.configs.split(",") if c]
    setups = [x for x in args.setups.split(",") if x]
    plan = ([(c, x) for c in cfgs for x in setups] if args.order == "config" else
            [(c, x) for x in setups for c in cfgs])
    for (size, batch), setup in plan:
        record(measure(setup, size, batch, args.steps, args.warmup, args.lean, "bench"), "bench")
    for setup in filter(None, args.largest.split(",")):
        res = search_largest(setup, [x for x in args.sizes.split(",") if x], args.first,
                             lambda size, setup=setup: record(measure(setup, size, args.batch, args.steps,
                                                                      args.warmup, True, "largest"), "largest"))
        res["batch"] = args.batch
        largest[setup] = res
        print(f"[{time.perf_counter() - t_start:6.0f} s] largest {setup} at batch {args.batch}: "
              f"{res['largest_fit']} ({res['largest_fit_params_B'] or 0:.2f}B params); does not fit: "
              f"{res['smallest_not_fit']}; tries: " +
              ", ".join(f"{t['size']} {'fits' if t['fits'] else (t['skipped'] or t['failure'])}" for t in res["tries"]),
              flush=True)
        save()
    if prebuild is not None:  # never waited for (no setup needed it): stop it
        prebuild[0].kill()
    rows_all = rows
    rows = [r for r in rows_all if "skipped" not in r and r.get("purpose") == "bench"]
    if rows:
        print(f"\n{'config':10s} {'setup':16s} {'step ms':>8s} {'tok/s':>8s} {'MFU':>5s} {'peak GiB':>8s} {'host GiB':>8s} "
              f"{'exposed':>8s} {'vs bf16':>7s} {'vs ao32':>7s} {'vs DS':>6s} {'host wall':>9s} {'stream':>7s} {'vs ao32':>7s}")
    for r in rows:
        cfg = f"{r['size']}x{r['batch']}"
        if "step_ms_median" not in r:
            print(f"{cfg:10s} {r['setup']:16s} {r.get('failure', 'error').upper()}: {r['error'][:200]}")
            continue
        same = {q["setup"]: q for q in rows if "step_ms_median" in q and q["size"] == r["size"] and q["batch"] == r["batch"]}
        b = same.get("bf16_fused", {}).get("step_ms_median", math.nan)
        t = same.get("torchao_fp32", {}).get("step_ms_median", math.nan)
        ds = same.get("ds_zero_offload", {}).get("step_ms_median", math.nan)
        ts = same.get("torchao_fp32", {}).get("step_ms_stream", math.nan)
        ms = r["step_ms_median"]
        st = r.get("step_ms_stream", math.nan)
        r["exposed_ms"] = ms - b
        hg = r.get("host_used_peak_gib", r.get("host", {}).get("VmHWM_gib", math.nan))
        print(f"{cfg:10s} {r['setup']:16s} {ms:8.1f} {r['tokens_per_s']:8.0f} {100 * r['mfu']:5.1f} {r['peak_gib']:8.2f} "
              f"{hg:8.1f} {ms - b:8.1f} {ms / b:7.2f} {ms / t:7.2f} {ms / ds:6.2f} "
              f"{r.get('host_update_wall_ms_last', math.nan):9.1f} {st:7.1f} {st / ts:7.2f}")
    for r in rows:
        # Issue #6's clipping target: TrainStream with ~clipX vs bf16_fused~clipX of the same config.
        name = r.get("setup", "")
        if "step_ms_median" not in r or not name.startswith("ts_") or "~clip" not in name:
            continue
        clip_opt = next(o for o in name.split("~")[1:] if o.startswith("clip"))
        base = next((q for q in rows if "step_ms_median" in q and q["size"] == r["size"] and q["batch"] == r["batch"]
                     and q["setup"] == f"bf16_fused~{clip_opt}"), None)
        if base is None:
            continue
        host = r.get("host_update_wall_ms_last", math.nan)
        target = (base["step_ms_median"] + max(0.0, host - base["forward_ms"])) * 1.05
        r["clip_target_ms"] = target
        print(f"\nclipping target {r['size']}x{r['batch']} {name}: (bf16 {base['step_ms_median']:.1f} + max(0, host update "
              f"{host:.1f} - forward {base['forward_ms']:.1f})) x 1.05 = {target:.1f} ms; measured "
              f"{r['step_ms_median']:.1f} ms ({r['step_ms_median'] / target:.2f}x the target)")
    if any("mem_phases" in r for r in rows):
        print("\nGPU memory by phase of one step, GiB (allocated at the end / peak within):")
        for r in rows:
            mp = r.get("mem_phases")
            if mp:
                print(f"  {r['size']}x{r['batch']} {r['setup']:24s} " + "  ".join(
                    f"{k} {v['end_gib']:6.2f}/{v['peak_gib']:6.2f}" for k, v in mp.items()))
    for r in rows:
        tl = r.get("gpu_timeline")
        if tl:
            print(f"\nGPU timeline {r['size']}x{r['batch']} {r['setup']}: span {tl['span_ms_per_step']:.1f} ms/step, "
                  f"kernels busy {tl['kernel_busy_ms_per_step']:.1f}, idle {tl['idle_ms_per_step']:.1f}; copies busy "
                  f"H2D {tl.get('memcpy_HtoD_busy_ms_per_step', 0):.1f}, D2H {tl.get('memcpy_DtoH_busy_ms_per_step', 0):.1f}"
                  f" ms/step; largest gaps:")
            for gp in tl["largest_gaps"]:
                print(f"   {gp['ms']:7.2f} ms at {gp['at_ms']:8.1f} ms  after {gp['after']}  before {gp['before']}")
    for r in rows:
        tr = r.get("host_trace")
        if tr:
            print(f"\nhost timeline {r['size']}x{r['batch']} {r['setup']} ({tr['workers']} workers), ms:")
            print(f"  {'phase':9s} {'at':>7s} {'len':>7s} {'kernel':>7s} {'util':>5s} {'jobwait':>7s} "
                  f"{'upload':>6s} {'ready n/total/max':>20s} {'hook n/total/max':>20s} {'tail':>6s}")
            for p in tr["phases"]:
                w, h = p["wait_ready"], p["offload_grad"]
                print(f"  {p['phase']:9s} {p['t0_ms']:7.1f} {p['ms']:7.1f} {p['worker_kernel_ms']:7.1f} "
                      f"{p['worker_util']:5.2f} {p['worker_wait_ms']:7.1f} {p['worker_upload_ms']:6.1f} "
                      f"{w['n']:5d}/{w['total_ms']:7.1f}/{w['max_ms']:6.1f} "
                      f"{h['n']:5d}/{h['total_ms']:7.1f}/{h['max_ms']:6.1f} {p.get('host_tail_ms', 0.0):6.1f}")
    rows = rows_all
    cap = max((r.get("gpu_total_gib", 0) for r in rows if "step_ms_median" in r), default=0)
    big = largest_models(rows, cap) if cap else {}
    if big:
        print(f"\nlargest model in {cap:.0f} GiB of GPU memory (linear extrapolation of peak memory):")
        for k, v in sorted(big.items()):
            print(f"  {k:30s} {v['params_B']:6.1f} B params ({v['gib_per_B_params']:.1f} GiB per B params)")
    for setup, res in largest.items():
        print(f"largest measured: {setup} at batch {res['batch']}: {res['largest_fit']} "
              f"({res['largest_fit_params_B'] or 0:.2f}B); not fitting: {res['smallest_not_fit']}")
    save()
    print(f"total {time.perf_counter() - t_start:.0f} s" + (f"; JSON {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
