#!/usr/bin/env bash
# One call on the GPU machine: every GPU test at this commit, then the FSDP2 benchmark at world size 1
# and the host AdamW benchmark.   bash scripts/gpu_check.sh $OUT   (stages: STAGES="tests fsdp host";
# also "zc": bench_zero_copy with its staged rings; "train": bench_train with TRAIN_ARGS)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/ts_out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests fsdp host"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --find-links .whl pytest-xdist torchao deepspeed > "$OUT/pip.log" 2>&1
{ date -u; git log -1 --format=%H 2>/dev/null; echo "commit: ${COMMIT:-?}"; nvidia-smi -L; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$OUT/env.txt" 2>&1
if has tests; then
  # The kernel matrix in 6 processes beside the adapters' tests (one GPU, plenty of memory).
  timeout "${KT:-330}" python3 -m pytest -m gpu -q -ra -p no:cacheprovider -n 5 tests/test_device_kernels.py \
    ${KERNEL_K:+-k "$KERNEL_K"} > "$OUT/gpu_kernels.log" 2>&1 &
  timeout "${AT:-330}" python3 -m pytest -m gpu -q -ra -p no:cacheprovider -n 4 --dist loadfile \
    ${GPU_TESTS:-tests/test_torch_gpu.py tests/test_torch_loops.py tests/test_torch_readiness.py tests/test_cuda_driver.py \
    tests/test_jax_gpu.py tests/test_wheel_install.py tests/test_torch_dist.py tests/test_host_budget.py} > "$OUT/gpu_tests.log" 2>&1
  wait
  tail -n 15 "$OUT/gpu_kernels.log"; tail -n 25 "$OUT/gpu_tests.log"
fi
if has fsdp; then
  timeout "${FT:-150}" torchrun --standalone --nproc_per_node=1 experiments/bench_fsdp.py --size "${FSDP_SIZE:-350m}" \
    --steps 6 --warmup 2 --json "$OUT/bench_fsdp.json" > "$OUT/bench_fsdp.log" 2>&1
  grep -v '^{' "$OUT/bench_fsdp.log" | tail -n 20
fi
if has host; then
  timeout "${HT:-80}" python3 experiments/bench_host_adamw.py --numel 134217728 --threads 16 --json "$OUT/bench_host.json" \
    > "$OUT/bench_host.log" 2>&1; tail -n 15 "$OUT/bench_host.log"
fi
if has zc; then
  timeout "${ZT:-150}" python3 experiments/bench_zero_copy.py --out "$OUT/bench_zero_copy.json" > "$OUT/bench_zero_copy.log" 2>&1
  tail -n 30 "$OUT/bench_zero_copy.log"
fi
if has train; then
  timeout "${TT:-400}" python3 experiments/bench_train.py ${TRAIN_ARGS:?} --json "$OUT/bench_train.json" \
    > "$OUT/bench_train.log" 2>&1; grep -v '^{' "$OUT/bench_train.log" | tail -n 30
fi
