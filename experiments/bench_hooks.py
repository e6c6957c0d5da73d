# python experiments/bench_hooks.py --layers 96 --width 256 --steps 30 --json $OUT/bench_hooks.json
"""Grouped gradient hooks on and off (``OffloadAdamW(hook_group_elems=...)``), same process.

A deep stack of small layers has many small parameters, so each step runs many
post-accumulate-grad hooks; under busy worker threads the autograd thread waits for the
GIL to enter each one. For each setting (one hook per parameter: ``0``; grouped: the
default 4M elements, and ``--group`` values) the script trains the same model with the
eager path (``last_micro_batch``) and reports the median step time, the median time of
``backward()`` alone (host side), and the hooks that ran per step. Runs on CUDA if
present, else on the CPU (where the figures only say how much Python work the hooks
cost). Before timing, every setting's weights after the run are compared with the first
setting's: grouping must not change a bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn as nn


def model(layers: int, width: int, device) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks).to(device)


def run(group: int, args, device) -> dict:
    from trainstream.torch import OffloadAdamW

    m = model(args.layers, args.width, device)
    opt = OffloadAdamW(m.parameters(), lr=1e-3, hook_group_elems=group, threads=args.threads)
    g = torch.Generator(device="cpu").manual_seed(1)
    xs = [torch.randn(args.batch, args.width, generator=g).to(device) for _ in range(args.steps)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps, backs = [], []
    for i, x in enumerate(xs):
        sync()
        t0 = time.perf_counter()
        loss = m(x).square().mean()
        t1 = time.perf_counter()
        with opt.last_micro_batch():
            loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync()
        if i >= 3:  # the first step records the hooks' order; then they are grouped
            steps.append(time.perf_counter() - t0)
            backs.append(t2 - t1)
    opt.synchronize()
    hooks = len(opt._hooks)
    weights = [p.detach().cpu().clone() for p in m.parameters()]
    opt.close()
    return {"group": group, "hooks": hooks, "params": len(weights), "step_ms": 1e3 * statistics.median(steps),
            "backward_ms": 1e3 * statistics.median(backs), "weights": weights}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--group", default="0,4194304", help="comma list of hook_group_elems values")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [run(int(gv), args, device) for gv in args.group.split(",")]
    base = rows[0]
    for r in rows[1:]:
        same = all(torch.equal(a, b) for a, b in zip(base["weights"], r["weights"]))
        if not same:
            sys.exit(f"hook_group_elems={r['group']} changed the weights: grouping must not change a bit")
    print(f"{device.type}, {args.layers} x (LayerNorm + Linear {args.width}), {base['params']} parameters, eager path")
    print(f"{'hook_group_elems':>16s} {'hooks':>6s} {'step ms':>8s} {'backward ms':>11s} {'vs first':>8s}")
    for r in rows:
        print(f"{r['group']:16d} {r['hooks']:6d} {r['step_ms']:8.2f} {r['backward_ms']:11.2f} "
              f"{r['step_ms'] / base['step_ms']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device.type,
                       "rows": [{k: v for k, v in r.items() if k != "weights"} for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
