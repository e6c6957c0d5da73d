#!/usr/bin/env bash
# The main job on a fresh machine: set up, then train a small GPT with TrainStream beside
# torch.optim.AdamW (CUDA if present, else CPU) and report bit-identity, timings, stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python experiments/train_demo.py "$@"
