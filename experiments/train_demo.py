# Run: python experiments/train_demo.py            (after: pip install torch==2.13.0 && pip install -e ".[torch,test]")
# or simply: bash scripts/main_job.sh
"""The main job: a small GPT-style training run, TrainStream's OffloadAdamW beside
torch.optim.AdamW, same data, same initial weights. Prints whether every weight is
bit-identical after training, the time per step of each, and the engine's stats().
Runs on CUDA when present, else on the CPU."""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainstream.torch import OffloadAdamW

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is in the test extra
    def tqdm(x, **_):
        return x


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 4, heads: int = 4, ctx: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def text_batches(steps: int, batch: int, ctx: int, device, seed: int = 0):
    """Byte-level batches from text generated here (nothing is downloaded)."""
    g = torch.Generator().manual_seed(seed)
    words = ["offload", "adam", "weights", "host", "memory", "stream", "exact", "bits", "gpu", "step"]
    text = " ".join(words[i] for i in torch.randint(0, len(words), (20000,), generator=g).tolist())
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    for _ in range(steps):
        ix = torch.randint(0, len(data) - ctx - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + ctx] for i in ix])
        y = torch.stack([data[i + 1 : i + ctx + 1] for i in ix])
        yield x.to(device), y.to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    ref_model = TinyGPT().to(device)
    ts_model = copy.deepcopy(ref_model)
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **hp)
    ts_opt = OffloadAdamW(ts_model.parameters(), **hp, max_grad_norm=args.max_grad_norm)
    n_params = sum(p.numel() for p in ref_model.parameters())
    print(f"TinyGPT: {n_params / 1e6:.2f}M parameters on {device}; {args.steps} steps")

    times = {"torch.optim.AdamW": 0.0, "trainstream OffloadAdamW": 0.0}
    losses = {k: [] for k in times}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step, (x, y) in enumerate(tqdm(list(text_batches(args.steps, args.batch, 64, device)), desc="training")):
        for name, model, opt in (
            ("torch.optim.AdamW", ref_model, ref_opt),
            ("trainstream OffloadAdamW", ts_model, ts_opt),
        ):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            if args.max_grad_norm is not None and opt is ref_opt:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            sync()
            if step > 0:  # the first step compiles kernels
                times[name] += time.perf_counter() - t0
            losses[name].append(loss.item())
    ts_opt.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), ts_model.parameters()))
    print()
    for name in times:
        print(f"{name:28s} final loss {losses[name][-1]:.4f}   {1e3 * times[name] / max(1, args.steps - 1):8.2f} ms/step")
    print(f"weights bit-identical after {args.steps} steps: {same}")
    print("stats():")
    for k, v in ts_opt.stats().items():
        print(f"  {k:24s} {v:,.3f}")
    ts_opt.close()
    if not same and args.max_grad_norm is None:
        raise SystemExit("FAILED: TrainStream diverged from torch.optim.AdamW")


if __name__ == "__main__":
    main()
