# Run: python experiments/train_demo.py [--steps 30]   (or bash scripts/main_job.sh: set-up, then this)
"""The main job: a small GPT trained by TrainStream's OffloadAdamW beside torch.optim.AdamW,
same data, same initial weights. Prints whether every weight is bit-identical after
training, the time per step of each, and the engine's stats(). Runs on CUDA when present,
else on the CPU."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from trainstream.torch import OffloadAdamW

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import tqdm  # noqa: E402
from models_torch import GPT, loss_of, text_batches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    # attention written out (sdpa=False): kernels that give both models the same gradients on any device
    ref_model = GPT(layers=4, d=128, heads=4, vocab=128, ctx=64, sdpa=False).to(device)
    ts_model = copy.deepcopy(ref_model)
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **hp)
    ts_opt = OffloadAdamW(ts_model.parameters(), **hp, max_grad_norm=args.max_grad_norm)
    n_params = sum(p.numel() for p in ref_model.parameters())
    print(f"GPT: {n_params / 1e6:.2f}M parameters on {device}; {args.steps} steps")

    times = {"torch.optim.AdamW": 0.0, "trainstream OffloadAdamW": 0.0}
    losses = {k: [] for k in times}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step, (x, y) in enumerate(tqdm(text_batches(args.steps, args.batch, 64), desc="training")):
        x, y = x.to(device), y.to(device)
        for name, model, opt in (("torch.optim.AdamW", ref_model, ref_opt),
                                 ("trainstream OffloadAdamW", ts_model, ts_opt)):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_of(model, x, y)
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
