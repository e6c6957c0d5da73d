# Run (GPU machine): python experiments/bench_torch_offload.py --model 350m --batch 8 --seq 1024 --json $OUT/bench_torch.json
"""Step time and peak GPU memory of a GPT-style model trained with OffloadAdamW beside the
in-GPU baselines and torchao's CPUOffloadOptimizer, all in one process.

Setups (bf16 matmuls everywhere):
  amp_fused      fp32 weights + bf16 autocast + torch.optim.AdamW(fused=True) in GPU memory
  bf16_fused     bf16 weights + torch.optim.AdamW(fused=True) in GPU memory
  ts_cpu         bf16 weights, OffloadAdamW mode="cpu" (fp32 master + moments on the host)
  ts_cpu_eager   the same, update started during backward (last_micro_batch)
  ts_gpu         bf16 weights, OffloadAdamW mode="gpu" (zero-copy kernel), if available
  torchao_fp32   fp32 weights + autocast + torchao CPUOffloadOptimizer (fp32 host state:
                 our numerics)
  torchao_bf16   bf16 weights + torchao CPUOffloadOptimizer (its recommended bf16 setup)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def build(setup, size, device):
    """``setup`` may end in ``@N`` or ``@N:C``: N host threads, chunks of C elements."""
    setup, _, opts = setup.partition("@")
    threads, _, chunk = opts.partition(":")
    threads = int(threads) if threads else None
    chunk = int(chunk) if chunk else 1 << 20
    layers, d, heads = SIZES[size]
    torch.manual_seed(0)
    dtype = torch.float32 if setup in ("amp_fused", "torchao_fp32") else torch.bfloat16
    model = GPT(layers, d, heads).to(device=device, dtype=dtype)
    params = list(model.parameters())
    lr = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    autocast = dtype == torch.float32
    eager = False
    if setup in ("amp_fused", "bf16_fused"):
        opt = torch.optim.AdamW(params, fused=True, **lr)
    elif setup.startswith("ts_"):
        from trainstream.torch import OffloadAdamW

        opt = OffloadAdamW(params, mode="gpu" if setup == "ts_gpu" else "cpu", threads=threads, chunk_size=chunk, **lr)
        eager = setup == "ts_cpu_eager"
    else:
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True, **lr)
    return model, opt, autocast, eager


def run(setup, size, batch, seq, steps, warmup, device):
    model, opt, autocast, eager = build(setup, size, device)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, 50304, (batch, seq), device=device, generator=g)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        if eager:
            with opt.last_micro_batch():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        # The next step's forward waits per layer; time to the point where the next
        # iteration could start (CPU offload steps finish asynchronously).
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
    # Let asynchronous work drain (not timed) and take the peak.
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    extra = {}
    if hasattr(opt, "stats"):
        extra = {k: v for k, v in opt.stats().items() if k.endswith("_ms_total") or k == "threads"}
    if hasattr(opt, "close"):
        opt.close()
    del model, opt, logits, loss
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "setup": setup,
        "size": size,
        "params_M": n_params / 1e6,
        "batch": batch,
        "seq": seq,
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
        "peak_gib": peak,
        **extra,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="350m", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--setups", default="amp_fused,bf16_fused,ts_cpu,ts_cpu_eager,ts_gpu,torchao_fp32,torchao_bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_torch_offload.py needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for setup in args.setups.split(","):
        try:
            row = run(setup, args.model, args.batch, args.seq, args.steps, args.warmup, device)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other setups
            row = {"setup": setup, "size": args.model, "error": f"{type(exc).__name__}: {exc}"[:300]}
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    by = {r["setup"]: r for r in rows if "error" not in r}
    print(f"\n{'setup':14s} {'step ms':>9s} {'peak GiB':>9s} {'vs bf16':>8s} {'vs torchao_fp32':>16s}")
    for r in rows:
        if "error" in r:
            print(f"{r['setup']:14s} ERROR {r['error']}")
            continue
        vb = r["step_ms_median"] / by["bf16_fused"]["step_ms_median"] if "bf16_fused" in by else math.nan
        vt = r["step_ms_median"] / by["torchao_fp32"]["step_ms_median"] if "torchao_fp32" in by else math.nan
        print(f"{r['setup']:14s} {r['step_ms_median']:9.1f} {r['peak_gib']:9.2f} {vb:8.2f} {vt:16.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
