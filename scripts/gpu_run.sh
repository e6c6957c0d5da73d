#!/usr/bin/env bash
# One call on the GPU machine (device image: torch, jax, cupy, numba already there):
#   STAGES="tests jax zc host train" TRAIN_CONFIGS=1.3b:24 bash scripts/gpu_run.sh OUTDIR
# Runs the chosen stages (default: all), logs everything under OUTDIR.
#   tests  the GPU tests (torch, kernels, JAX on CUDA, the installed wheel) -> gpu_tests.log
#   jax    experiments/bench_jax_offload.py (issue #5)        -> bench_jax.{log,json}
#   zc     experiments/bench_zero_copy.py (issue #4)          -> bench_zero_copy.{log,json}
#   host   experiments/bench_host_adamw.py (issue #2)         -> bench_host.{log,json}
#   contention  experiments/contention.py (host threads vs DMA) -> contention.{log,json}
#   probe  experiments/zero_copy_probe.py (SM access over PCIe) -> zero_copy_probe.{log,json}
#   train  experiments/bench_train.py on $TRAIN_CONFIGS (#6)  -> bench_train.{log,json}
#   equiv  experiments/equivalence_{torch,jax}.py on CUDA     -> equivalence_*/
# Wheels in .whl/ (torchao, deepspeed and its pure-Python dependencies) are installed
# first, without touching what the image already has.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/ts_out}}
mkdir -p "$OUT"
STAGES=${STAGES:-"tests jax zc host train"}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
has() { [[ " $STAGES " == *" $1 "* ]]; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links .whl torchao deepspeed > /tmp/pip.log 2>&1
  tail -n 3 /tmp/pip.log
fi
{
  echo "commit (from the caller): ${COMMIT:-unknown}"
  date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi -L; lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, numba, numpy, jax, cupy; print('torch', torch.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'jax', jax.__version__, 'cupy', cupy.__version__)"
  echo "g++: $(command -v g++ || echo none)  nvcc: $(command -v nvcc || echo none)"
  python3 -c "import jax, os, shutil; shutil.copy(os.path.join(jax.ffi.include_dir(), 'xla/ffi/api/c_api.h'), '$OUT/c_api.h')"
  tail -n 3 /tmp/pip.log 2>/dev/null
} 2>&1 | tee "$OUT/env.txt"
if has tests; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false TRAINSTREAM_GPU_TEST_STEPS=${TRAINSTREAM_GPU_TEST_STEPS:-10} \
    timeout "${TS_TEST_TIMEOUT:-300}" python3 -m pytest -q -ra -s -p no:cacheprovider \
    ${GPU_TESTS:-tests/test_jax_gpu.py tests/test_torch_gpu.py tests/test_device_kernels.py tests/test_contract.py \
    tests/test_engine_queue.py tests/test_torch_optimizer.py::test_two_groups_bit_identical tests/test_wheel_install.py} > "$OUT/gpu_tests.log" 2>&1
  grep -E "max ULP|mode=.*args" "$OUT/gpu_tests.log" | head -n 20
  tail -n 25 "$OUT/gpu_tests.log"
fi
if has jax; then
  timeout "${JAX_TIMEOUT:-150}" python3 experiments/bench_jax_offload.py --params 268M --json "$OUT/bench_jax.json" 2>&1 | tail -n 12
  if [ -n "${JAX_GPT:-}" ]; then  # e.g. JAX_GPT=350m: issue #6's JAX counterpart
    timeout "${JAX_TIMEOUT:-150}" python3 experiments/bench_jax_offload.py --model "gpt:$JAX_GPT" --batch 8 --seq 1024 \
      --json "$OUT/bench_jax_gpt.json" 2>&1 | tail -n 8
  fi
fi
if has zc; then
  timeout 80 python3 experiments/bench_zero_copy.py --numel 268435456 --out "$OUT/bench_zero_copy.json" 2>&1 | tail -n 20 | tee "$OUT/bench_zero_copy.log"
fi
if has host; then
  timeout 80 python3 experiments/bench_host_adamw.py --numel 134217728 --threads 16 --json "$OUT/bench_host.json" 2>&1 | tail -n 15 | tee "$OUT/bench_host.log"
fi
if has contention; then
  timeout 90 python3 experiments/contention.py --json "$OUT/contention.json" 2>&1 | tee "$OUT/contention.log"
fi
if has probe; then
  timeout 120 python3 experiments/zero_copy_probe.py --json "$OUT/zero_copy_probe.json" > "$OUT/zero_copy_probe.log" 2>&1
  tail -n 40 "$OUT/zero_copy_probe.log"
fi
if has train; then
  timeout "${TRAIN_TIMEOUT:-240}" python3 experiments/bench_train.py --configs "${TRAIN_CONFIGS:-350m:8}" \
    ${TRAIN_SETUPS:+--setups "$TRAIN_SETUPS"} ${TRAIN_EXTRA:-} --json "$OUT/bench_train.json" > "$OUT/bench_train.log" 2>&1
  grep -v '^{' "$OUT/bench_train.log" | tail -n 40
fi
if has equiv; then
  # One process per dtype and script, all at once (the device has 16 cores; each process
  # drives a tiny model, so they hardly compete): session 3's single process did not get
  # through 100 CUDA steps in 115 s. Each script writes its tables after every setting, so
  # a run cut short by the timeout still leaves its finished rows. One tarball comes back.
  mkdir -p /tmp/ts_equiv
  for dt in ${EQUIV_DTYPES:-fp32 bf16 fp16}; do
    timeout "${EQUIV_TIMEOUT:-240}" python3 experiments/equivalence_torch.py --no-progress --dtypes "$dt" \
      ${EQUIV_TORCH_ARGS:---devices cpu,cuda --steps 100 --threads 2} \
      --out "/tmp/ts_equiv/equivalence_torch_$dt" > "/tmp/ts_equiv/equivalence_torch_$dt.log" 2>&1 &
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${EQUIV_TIMEOUT:-240}" python3 experiments/equivalence_jax.py \
      --no-progress --dtypes "$dt" ${EQUIV_JAX_ARGS:---devices cpu,gpu --steps 100 --threads 2} \
      --out "/tmp/ts_equiv/equivalence_jax_$dt" > "/tmp/ts_equiv/equivalence_jax_$dt.log" 2>&1 &
  done
  wait
  for f in /tmp/ts_equiv/*.log; do echo "== $f"; tail -n 4 "$f"; done
  tar czf "$OUT/equivalence.tgz" -C /tmp/ts_equiv .
fi
