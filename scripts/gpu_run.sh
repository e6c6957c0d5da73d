#!/usr/bin/env bash
# One call on the GPU machine (device image: torch, jax, cupy, numba already there):
#   bash scripts/gpu_run.sh OUTDIR
# Runs the GPU tests and the GPU benchmarks, logs everything under OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/ts_out}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi -L; lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, numba, numpy, jax, cupy; print('torch', torch.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'jax', jax.__version__, 'cupy', cupy.__version__)"
} 2>&1 | tee "$OUT/env.txt"
T=${TS_TEST_TIMEOUT:-200}
TRAINSTREAM_GPU_TEST_STEPS=${TRAINSTREAM_GPU_TEST_STEPS:-10} timeout "$T" python3 -m pytest -q -ra -p no:cacheprovider \
  tests/test_torch_gpu.py tests/test_device_kernels.py tests/test_contract.py \
  "tests/test_torch_optimizer.py::test_two_groups_bit_identical" > "$OUT/gpu_tests.log" 2>&1
tail -n 25 "$OUT/gpu_tests.log"
timeout 80 python3 experiments/bench_zero_copy.py --numel 268435456 --out "$OUT/bench_zero_copy.json" 2>&1 | tail -n 20 | tee "$OUT/bench_zero_copy.log"
timeout 80 python3 experiments/bench_host_adamw.py --numel 134217728 --threads 16 --json "$OUT/bench_host.json" 2>&1 | tail -n 15 | tee "$OUT/bench_host.log"
timeout 150 python3 experiments/bench_torch_offload.py --model 350m --batch 8 --seq 1024 --json "$OUT/bench_torch.json" 2>&1 | tail -n 20 | tee "$OUT/bench_torch.log"
timeout 45 python3 experiments/train_demo.py --steps 30 2>&1 | tail -n 25 | tee "$OUT/train_demo.log"
