# Run: python experiments/spec_redo_text.py --steps 500 [--device cpu|cuda] [--json out.json]
"""Issue 42's "fraction of steps redone in a real run": a small GPT (``models_torch.GPT``, byte-level, 256
tokens) trained ``--steps`` steps on real English text (the installed packages' ``METADATA`` descriptions and
this repository's Markdown, read in a fixed order) in the loop trainers run: ``backward``,
``clip_grad_norm_(params, --max-norm)``, ``step``, ``zero_grad``, no ``last_micro_batch()``. The same loop runs
with ``torch.optim.AdamW`` (same implementation flag) beside it, same data: every step's clipping factor is
logged from torch's run, and at the end both runs' weights are compared bitwise.

Prints the steps whose gradients clip (factor < 1: the speculative update is redone), OffloadAdamW's counters
(``spec_steps_committed``, ``spec_steps_redone``, ``redo_ms_total``) and whether the weights are identical.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models_torch import GPT  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def real_text(min_bytes: int) -> bytes:
    """English prose found on any machine with this repository and its dependencies, in a fixed order."""
    dirs = sorted({*site.getsitepackages(), site.getusersitepackages()})
    files = sorted(glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True))
    files += sorted(f for d in dirs for f in glob.glob(os.path.join(d, "*.dist-info", "METADATA")))
    out = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            out += fh.read()
        if len(out) >= min_bytes:
            break
    return bytes(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--fused", action="store_true", help="fused=True in both optimizers")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from trainstream.torch import OffloadAdamW  # noqa: PLC0415

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    text = torch.frombuffer(bytearray(real_text(args.steps * args.batch * args.seq // 4 + 4096)), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    hp = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=args.fused)
    runs = {}
    for name in ("torch", "ours"):
        torch.manual_seed(0)
        model = GPT(args.layers, args.d, 4, vocab=256, ctx=args.seq, device=dev, dtype=dtype)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, **hp) if name == "torch" else OffloadAdamW(params, mode="cpu", **hp)
        runs[name] = (model, params, opt)
    factors, t0 = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, text.numel() - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([text[s:s + args.seq + 1] for s in starts.tolist()]).long().to(dev)
        for name, (model, params, opt) in runs.items():
            loss = F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, args.max_norm)
            if name == "torch":  # torch's clip factor: clamp(max_norm / (norm + 1e-6), max=1.0)
                factors.append(min(args.max_norm / (float(norm) + 1e-6), 1.0))
            opt.step()
            opt.zero_grad()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f}, norm {float(norm):.3f}", flush=True)
    wall = time.perf_counter() - t0
    ours = runs["ours"][2]
    ours.synchronize() if hasattr(ours, "synchronize") else None
    st = ours.stats()
    same = all(torch.equal(a, b) for a, b in zip(runs["torch"][1], runs["ours"][1]))
    clipped = [i for i, f in enumerate(factors) if f < 1.0]
    row = {"steps": args.steps, "clipped_steps": len(clipped), "last_clipped_step": clipped[-1] if clipped else None,
           "clipped_after_100": sum(i >= 100 for i in clipped),
           **{k: st.get(k) for k in ("spec_steps_committed", "spec_steps_redone", "redo_ms_total")},
           "bit_identical": same, "wall_s": wall, "args": vars(args)}
    ours.close()
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
