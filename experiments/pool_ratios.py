# Run: python experiments/pool_ratios.py experiments/data/2026-11-30_s6_run*_bench_train_*.json --config 350m:8 --setups ts_hybrid,ts_hybrid_eager~nice19
"""Ratios of TrainStream setups to torchao (fp32 state, our numerics) over several
``bench_train.py`` JSON files: per file (run) the ratio of the medians of each setup's
rows, and over all files the ratio of the pooled medians; for the synchronized step
(``step_ms_median``) and, where recorded, the back-to-back step (``step_ms_stream``).

The host of the GPU machine is shared, and torchao's step moves by 20-30% between runs;
setups measured in one process, interleaved, are the comparison that holds.
"""

from __future__ import annotations

import argparse
import json
import statistics


def _rows(path: str, size: str, batch: int) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    # rows of bench_train.py only (other JSON in the same folder, e.g. host_pages.py, has none)
    return [r for r in data.get("rows", []) if "error" not in r and r.get("size") == size and r.get("batch") == batch]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--config", default="350m:8", help="model:batch")
    ap.add_argument("--setups", default="ts_hybrid", help="comma-separated TrainStream setups")
    ap.add_argument("--peer", default="torchao_fp32")
    args = ap.parse_args()
    size, _, batch = args.config.partition(":")
    batch = int(batch or 8)
    pooled: dict = {}
    print(f"{args.config}, ratio of medians to {args.peer} (rows in brackets)")
    print(f"{'file':60s} {'setup':28s} {'sync':>12s} {'stream':>12s}")
    for path in args.files:
        rows = _rows(path, size, batch)
        peer = [r for r in rows if r["setup"] == args.peer]
        if not peer:
            continue
        for setup in args.setups.split(","):
            ours = [r for r in rows if r["setup"] == setup]
            if not ours:
                continue
            cells = []
            for key in ("step_ms_median", "step_ms_stream"):
                a = [r[key] for r in ours if key in r]
                b = [r[key] for r in peer if key in r]
                pooled.setdefault((setup, key), ([], []))
                pooled[(setup, key)][0].extend(a)
                pooled[(setup, key)][1].extend(b)
                cells.append(f"{statistics.median(a) / statistics.median(b):.3f} [{len(a)}/{len(b)}]" if a and b else "-")
            print(f"{path[-60:]:60s} {setup:28s} {cells[0]:>12s} {cells[1]:>12s}")
    print("\npooled over the files:")
    for (setup, key), (a, b) in sorted(pooled.items()):
        if a and b:
            print(f"  {setup:28s} {key:15s} {statistics.median(a):7.1f} / {statistics.median(b):7.1f} ms "
                  f"= {statistics.median(a) / statistics.median(b):.3f} ({len(a)} / {len(b)} rows)")


if __name__ == "__main__":
    main()
