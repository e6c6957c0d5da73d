#!/usr/bin/env bash
# Run (GPU machine): bash experiments/ab_trees.sh OUTDIR BASE_TREE
#   BASE_TREE: an extracted older tree (trainstream/, kernels/, experiments/bench_train.py,
#   experiments/_common.py), e.g. made here with
#   git archive COMMIT trainstream kernels experiments/bench_train.py experiments/_common.py | tar -x -C .ab/base
# A/B of this tree against BASE_TREE in alternating processes (bench_train.py of each tree):
# 350M x 8 with ts_hybrid (order base, new, new, base) and 1.3B x 24 with ts_cpu_eager
# (base, new), bf16_fused beside each as the in-GPU reference; logs and JSON under OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUTDIR}; BASE=${2:?BASE_TREE}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # tree config setups tag
  local tree=$1 cfg=$2 setups=$3 tag=$4 root script
  if [ "$tree" = base ]; then root=$BASE; else root=$PWD; fi
  script=$root/experiments/bench_train.py
  PYTHONPATH=$root timeout "${AB_TIMEOUT:-150}" python3 "$script" --configs "$cfg" --setups "$setups" \
    --steps "${AB_STEPS:-8}" --warmup 3 --stream-steps 6 --json "$OUT/ab_${tag}.json" > "$OUT/ab_${tag}.log" 2>&1
  echo "$tag rc=$?"; grep -E "(bf16_fused|ts_[a-z_]+) +[0-9]" "$OUT/ab_${tag}.log" | head -n 4
}
S350="bf16_fused,ts_hybrid"; S13="bf16_fused,ts_cpu_eager"
run base 350m:8 $S350 350m_base1; run new 350m:8 $S350 350m_new1
run new 350m:8 $S350 350m_new2; run base 350m:8 $S350 350m_base2
run base 1.3b:24 $S13 1.3b_base1; run new 1.3b:24 $S13 1.3b_new1
