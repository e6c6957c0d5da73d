#!/bin/bash
# (copied into the main checkout as .wt_jax/run3.sh with this branch in .wt_jax/: see experiments/data/2026-12-02_h200_jax_state_flow.md)
# Device call 3 of the JAX helper (issue #19): the GPU tests of branch jax and the jitted
# step of the 268M MLP (and, time permitting, the 304M GPT) new vs old (main's tree).
# Usage (device, from the main checkout): bash .wt_jax/run3.sh   (writes under $OUT)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
ROOT=$PWD; NEW=$ROOT/.wt_jax
START=$(date +%s)
LOG=$OUT/run3.log
left() { echo $(( 228 - ($(date +%s) - START) )); }
run() {  # name cap dir cmd...
  local name=$1 cap=$2 dir=$3; shift 3
  local l=$(left)
  if [ "$l" -lt 12 ]; then echo "=== SKIP $name (time)" >> $LOG; return; fi
  [ "$cap" -gt "$l" ] && cap=$l
  echo "=== $name (cap ${cap}s) $(date +%T)" >> $LOG
  ( cd $dir && PYTHONPATH=$dir timeout -k 3 $cap "$@" ) >> $LOG 2>&1
  echo "=== $name rc=$? at $(( $(date +%s) - START ))s" >> $LOG
}
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import jax,optax,flax,cupy,numba;print('jax',jax.__version__,'optax',optax.__version__,'flax',flax.__version__,'cupy',cupy.__version__,'numba',numba.__version__)"; } >> $LOG 2>&1
run gpu_tests 118 $NEW python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_jax_gpu.py -rfE --durations=12
run bench_new_mlp 42 $NEW python3 experiments/bench_jax_offload.py --params 268M --setups optax_hbm,ts_gpu,ts_cpu --steps 6 --warmup 2 --json $OUT/bench_new_mlp268m.json
run bench_old_mlp 38 $ROOT python3 experiments/bench_jax_offload.py --params 268M --setups ts_gpu,ts_cpu --steps 6 --warmup 2 --json $OUT/bench_old_mlp268m.json
run bench_new_gpt 30 $NEW python3 experiments/bench_jax_offload.py --model gpt:350m --dtype float32 --batch 8 --seq 1024 --setups ts_gpu --steps 3 --warmup 1 --json $OUT/bench_new_gpt350m.json
run bench_old_gpt 30 $ROOT python3 experiments/bench_jax_offload.py --model gpt:350m --dtype float32 --batch 8 --seq 1024 --setups ts_gpu --steps 3 --warmup 1 --json $OUT/bench_old_gpt350m.json
echo "=== done at $(( $(date +%s) - START ))s" >> $LOG
