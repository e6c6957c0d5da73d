# Run (GPU machine): python experiments/bench_train.py --configs 125m:8,350m:8,1.3b:8,1.3b:24 --json $OUT/bench_train.json
"""End-to-end training benchmark: GPT-style models (125M, 350M, 1.3B; bf16 matmuls) on
batches of B x 1024 tokens, every optimizer placement in one process, per step time,
tokens/s and peak GPU memory.

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
~ebN (eager zero-copy kernels capped at N blocks: OffloadAdamW(eager_blocks=N); default: a
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
(trainstream._trace): a Chrome trace file per setup in --trace-dir and a summary per
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
import torch.nn as nn
import torch.nn.functional as F

from trainstream import _trace

SIZES = {  # (layers, d_model, heads)
    "tiny": (2, 256, 4),
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "1.3b": (24, 2048, 16),
}


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, vocab=50304, ctx=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
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


def build(setup, size, device, batch=8):
    """``setup`` may end in ``@N`` or ``@N:C``: N host threads, chunks of C elements; and
    in ``~options`` (module docstring)."""
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
    dtype = torch.float32 if setup in ("amp_fused", "torchao_fp32", "ds_zero_offload") else torch.bfloat16
    model = GPT(layers, d, heads).to(device=device, dtype=dtype)
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
        if mode == "hybrid":
            share = next((float(o[5:]) for o in opts_ if o.startswith("share")), None)
            if share is not None:
                extra["gpu_share"] = share
            if "last" in opts_:
                extra["gpu_params"] = "last"
        if "overlap" in opts_:
            extra["overlap_forward"] = model
        opt = OffloadAdamW(params, mode=mode, threads=threads, chunk_size=chunk, max_grad_norm=clip, **extra, **lr)
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


def run(setup, size, batch, seq, steps, warmup, device, profile=False, trace_dir=None, stream_steps=0):
    # What an earlier setup left allocated (torchao's optimizer, measured on the H200
    # machine, keeps its fp32 model alive after it is deleted): subtracted from the peak.
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model, opt, autocast, eager, clip_fn = build(setup, size, device, batch)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, 50304, (batch, seq), device=device, generator=g)
    times = []
    torch.cuda.reset_peak_memory_stats()
    stats0 = None

    def one_step():
        with _trace.span("forward"):
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
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
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_step()
        # The next step's forward waits per layer; time to the point where the next
        # iteration could start (CPU offload steps finish asynchronously).
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    # One more step, the memory of each phase: allocated at its end and the peak within it
    # (net of what earlier setups left): what the peak is made of (issue #6's B/param).
    phases = {}
    torch.cuda.synchronize()
    peak_timed = torch.cuda.max_memory_allocated()  # the phase probe resets the counter
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    del logits
    torch.cuda.synchronize()
    phases["forward"] = (torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base)
    torch.cuda.reset_peak_memory_stats()
    if opt is None:
        model.backward(loss)
    elif eager:
        with opt.last_micro_batch():
            loss.backward()
    else:
        loss.backward()
    del loss
    torch.cuda.synchronize()
    phases["backward"] = (torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base)
    torch.cuda.reset_peak_memory_stats()
    if opt is None:
        model.step()
    else:
        if clip_fn is not None:
            clip_fn()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    phases["step"] = (torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base)
    mem_phases = {k: {"end_gib": a / 2**30, "peak_gib": b / 2**30} for k, (a, b) in phases.items()}
    stream_ms = None
    if stream_steps:
        # Back to back, as a training loop runs: no device-wide synchronize between steps
        # (which also waits for work of the optimizer's own streams that the next forward
        # would overlap, e.g. hybrid's GPU share). One drain at the end, counted.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(stream_steps):
            one_step()
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        torch.cuda.synchronize()
        stream_ms = 1e3 * (time.perf_counter() - t0) / stream_steps
    fwd_ms = None
    if not setup.split("~")[0].split("@")[0].startswith(("ts_", "torchao", "ds_")):
        # The forward alone (with autograd's graph, then dropped), for the clipping target
        # of issue #6: in-GPU step + max(0, host update - next forward) + 5%.
        fwd = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                logits = model(x)
            F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
            torch.cuda.synchronize()
            fwd.append(time.perf_counter() - t0)
            del logits
        fwd_ms = 1e3 * statistics.median(fwd)
    trace = None
    if trace_dir is not None:
        _trace.start()
        for _ in range(2):
            with _trace.span("sync"):
                torch.cuda.synchronize()
            one_step()
        with _trace.span("sync"):
            torch.cuda.synchronize()
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        spans = _trace.stop()
        os.makedirs(trace_dir, exist_ok=True)
        with open(os.path.join(trace_dir, "trace_" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{size}x{batch}_{setup}") + ".json"), "w") as f:
            json.dump(_trace.chrome_trace(spans), f)
        trace = _trace.summary(spans, phases=("forward", "backward", "step", "sync"))
    timeline = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile  # noqa: PLC0415

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                one_step()
            torch.cuda.synchronize()
        timeline = gpu_timeline(prof, 3)
    # Let asynchronous work drain (not timed) and take the peak.
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    torch.cuda.synchronize()
    peak = (max(peak_timed, torch.cuda.max_memory_allocated()) - base) / 2**30
    extra = {}
    if hasattr(opt, "stats"):
        st = opt.stats()
        peak += st.get("gpu_state_bytes", 0.0) / 2**30  # ~res: GPU memory outside torch's allocator
        extra["threads"] = st.get("threads", 0.0)
        extra["host_update_wall_ms_last"] = st.get("last_step_wall_ms", 0.0)
        if stats0 is not None:
            # Per optimizer step since stats0: the timed steps and the memory, stream,
            # trace and profile steps after them (dividing by --steps alone overstated
            # both figures by the count of those extra steps).
            n = max(st["steps"] - stats0["steps"], 1.0)
            extra["worker_update_cpu_ms_per_step"] = (st["update_ms_total"] - stats0["update_ms_total"]) / n
            extra["ready_stall_ms_per_step"] = (st["ready_stall_ms_total"] - stats0["ready_stall_ms_total"]) / n
    if hasattr(opt, "close"):
        opt.close()
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    med = statistics.median(times)
    return {
        "setup": setup,
        "size": size,
        "params_M": n_params / 1e6,
        "batch": batch,
        "seq": seq,
        "step_ms_median": 1e3 * med,
        "step_ms_min": 1e3 * min(times),
        **({"step_ms_stream": stream_ms} if stream_ms is not None else {}),
        "mem_phases": mem_phases,
        "tokens_per_s": batch * seq / med,
        "peak_gib": peak,
        "left_by_earlier_setups_gib": base / 2**30,
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
        if "error" not in r:
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="350m:8", help="comma-separated model:batch, e.g. 125m:8,1.3b:24")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--setups", default="bf16_fused,amp_fused,ts_cpu,ts_cpu_eager,ts_gpu,torchao_fp32,torchao_bf16,ds_zero_offload")
    ap.add_argument("--profile", default="", help="comma list of setups to profile (3 more steps): GPU idle gaps")
    ap.add_argument("--trace", default="", help="comma list of setups to trace (2 more steps): host timeline")
    ap.add_argument("--trace-dir", default=".", help="where the Chrome trace files of --trace go")
    ap.add_argument("--stream-steps", type=int, default=6,
                    help="then time this many steps back to back, one drain at the end (0: off)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU")
    profiled = set(filter(None, args.profile.split(",")))
    traced = set(filter(None, args.trace.split(",")))
    device = torch.device("cuda")
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
    rows = []
    for cfg in args.configs.split(","):
        size, _, batch = cfg.partition(":")
        batch = int(batch or 8)
        for setup in args.setups.split(","):
            try:
                row = run(setup, size, batch, args.seq, args.steps, args.warmup, device, setup in profiled,
                          args.trace_dir if setup in traced else None, args.stream_steps)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other setups
                row = {"setup": setup, "size": size, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:400]}
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'config':10s} {'setup':16s} {'step ms':>8s} {'tok/s':>8s} {'peak GiB':>8s} {'exposed':>8s} "
          f"{'vs bf16':>7s} {'vs ao32':>7s} {'host wall':>9s} {'stream':>7s} {'vs ao32':>7s}")
    for r in rows:
        cfg = f"{r['size']}x{r['batch']}"
        if "error" in r:
            print(f"{cfg:10s} {r['setup']:16s} ERROR {r['error']}")
            continue
        same = {q["setup"]: q for q in rows if "error" not in q and q["size"] == r["size"] and q["batch"] == r["batch"]}
        b = same.get("bf16_fused", {}).get("step_ms_median", math.nan)
        t = same.get("torchao_fp32", {}).get("step_ms_median", math.nan)
        ts = same.get("torchao_fp32", {}).get("step_ms_stream", math.nan)
        ms = r["step_ms_median"]
        st = r.get("step_ms_stream", math.nan)
        r["exposed_ms"] = ms - b
        print(f"{cfg:10s} {r['setup']:16s} {ms:8.1f} {r['tokens_per_s']:8.0f} {r['peak_gib']:8.2f} {ms - b:8.1f} "
              f"{ms / b:7.2f} {ms / t:7.2f} {r.get('host_update_wall_ms_last', math.nan):9.1f} {st:7.1f} {st / ts:7.2f}")
    for r in rows:
        # Issue #6's clipping target: TrainStream with ~clipX vs bf16_fused~clipX of the same config.
        name = r.get("setup", "")
        if "error" in r or not name.startswith("ts_") or "~clip" not in name:
            continue
        clip_opt = next(o for o in name.split("~")[1:] if o.startswith("clip"))
        base = next((q for q in rows if "error" not in q and q["size"] == r["size"] and q["batch"] == r["batch"]
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
    big = largest_models(rows, capacity)
    if big:
        print(f"\nlargest model in {capacity:.0f} GiB (linear extrapolation of peak memory):")
        for k, v in sorted(big.items()):
            print(f"  {k:30s} {v['params_B']:6.1f} B params ({v['gib_per_B_params']:.1f} GiB per B params)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows, "largest_models": big}, f, indent=1)


if __name__ == "__main__":
    main()
