#!/usr/bin/env bash
# The GPU harness: GPU tests and benchmarks in one call on a GPU machine, logs under OUTDIR.
#   STAGES="tests demo" bash scripts/gpu_run.sh OUTDIR      (default STAGES: tests)
# Stages run in the order below, each under its own timeout (seconds, the variable named):
#   tests  every `-m gpu` test: test_device_kernels.py in 5 xdist workers beside every other
#          file in 4 (KT, AT: 330)                                  -> gpu_kernels.log, gpu_tests.log
#   demo   experiments/train_demo.py on CUDA (DT: 120)              -> demo.log
#   equiv  experiments/equivalence_{torch,jax}.py on CUDA, a process per dtype, EQUIV_STEPS steps
#          (default 100; ET: 240)                                   -> equivalence.tgz
#   fsdp   experiments/bench_fsdp.py, world size 1, FSDP_SIZE (350m; FT: 150) -> bench_fsdp.{log,json}
#   host   experiments/bench_host_adamw.py, interleaved (HT: 120)   -> bench_host.{log,json}
#   zc     experiments/bench_zero_copy.py (ZT: 150)                 -> bench_zero_copy.{log,json}
#   jax    experiments/bench_jax_offload.py, the 268M MLP; JAX_GPT=350m adds the GPT (JT: 150) -> bench_jax*.{log,json}
#   train  experiments/bench_train.py $TRAIN_ARGS (default --configs 350m:8; TT: 400) -> bench_train.{log,json}
#   jaxgpt experiments/bench_jax_gpt.py $JAXGPT_ARGS (default --sizes 1.3b,3b,7b; JGT: 500) -> bench_jax_gpt.{log,json}
#   largest experiments/largest_model.py $LARGEST_ARGS (default --profiles 24g64), resumable: its state is
#          LARGEST_STATE (default experiments/data/largest_model.json, in the working tree: carry it from one
#          call to the next), --budget LB (540) s; LT (580)     -> largest_model.{log,json}, largest_logs.tgz
# The device tool of this workplace returns at most 8 files from $OUT, 2 folders deep, and runs a
# command for at most 10 minutes: choose stages to fit; with more than 7 files at the end, all but
# env.txt go into OUTDIR/results.tgz. Wheels in .whl/ (pytest-xdist, expecttest, torchao, deepspeed and their
# dependencies) are installed first, each on its own (one missing does not stop the others; env.txt says which
# import), then .whl_titan/'s (torchtitan and its small dependencies; carry both folders); piplist.txt lists the
# image's packages. COMMIT names the caller's commit in env.txt. `bash scripts/fetch_wheels.sh` fills both folders here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/ts_out}}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  for pkg in pytest-xdist expecttest torchao deepspeed; do
    python3 -m pip install -q --no-index --find-links .whl "$pkg" >> "$OUT/pip.log" 2>&1 || echo "pip: $pkg not installed" >> "$OUT/pip.log"
  done
fi
if ls .whl_titan/*.whl >/dev/null 2>&1; then  # torchtitan and its small dependencies, without theirs (the image has torch)
  for w in .whl_titan/*.whl; do  # a distribution the image already has is left as it is
    dist=$(basename "$w" | cut -d- -f1)
    python3 -m pip show -q "$dist" >/dev/null 2>&1 && continue
    python3 -m pip install -q --no-index --no-deps "$w" >> "$OUT/pip.log" 2>&1 || echo "pip: $w not installed" >> "$OUT/pip.log"
  done
  python3 -c "import torchtitan.trainer" >> "$OUT/pip.log" 2>&1 && echo "torchtitan imports" >> "$OUT/pip.log"
fi
python3 -m pip list > "$OUT/piplist.txt" 2>&1
{ date -u; echo "commit: ${COMMIT:-?} (git here: $(git log -1 --format=%h 2>/dev/null))"; nvidia-smi -L
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, numba, jax, cupy; print('torch', torch.__version__, 'numba', numba.__version__, 'jax', jax.__version__, 'cupy', cupy.__version__)"
  python3 -c "import torchao, torchao.optim; print('torchao', torchao.__version__)" 2>&1 | tail -n 1
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -n 1
} > "$OUT/env.txt" 2>&1
if has tests; then
  timeout "${KT:-330}" python3 -m pytest -m gpu -q -ra -p no:cacheprovider -n 5 tests/test_device_kernels.py \
    > "$OUT/gpu_kernels.log" 2>&1 &
  timeout "${AT:-330}" python3 -m pytest -m gpu -q -ra -p no:cacheprovider -n 4 --dist loadfile tests \
    --ignore=tests/test_device_kernels.py > "$OUT/gpu_tests.log" 2>&1
  wait
  tail -n 5 "$OUT/gpu_kernels.log"; tail -n 25 "$OUT/gpu_tests.log"
fi
if has demo; then
  timeout "${DT:-120}" python3 experiments/train_demo.py > "$OUT/demo.log" 2>&1; grep -v "^  " "$OUT/demo.log" | tail -n 4
fi
if has equiv; then  # tiny models: the processes hardly compete; each writes its tables after every setting
  mkdir -p /tmp/ts_equiv
  for dt in ${EQUIV_DTYPES:-fp32 bf16 fp16}; do
    for script in torch jax; do
      timeout "${ET:-240}" python3 "experiments/equivalence_$script.py" --no-progress --dtypes "$dt" \
        --steps "${EQUIV_STEPS:-100}" --threads 2 --out "/tmp/ts_equiv/equivalence_${script}_$dt" \
        > "/tmp/ts_equiv/equivalence_${script}_$dt.log" 2>&1 &
    done
  done
  wait
  tail -q -n 1 /tmp/ts_equiv/*.log; tar czf "$OUT/equivalence.tgz" -C /tmp/ts_equiv .
fi
if has fsdp; then
  timeout "${FT:-150}" torchrun --standalone --nproc_per_node=1 experiments/bench_fsdp.py --size "${FSDP_SIZE:-350m}" \
    --steps 6 --warmup 2 --json "$OUT/bench_fsdp.json" > "$OUT/bench_fsdp.log" 2>&1; grep -v '^{' "$OUT/bench_fsdp.log" | tail -n 12
fi
if has host; then
  timeout "${HT:-120}" python3 experiments/bench_host_adamw.py --numel 134217728 --threads 16 --json "$OUT/bench_host.json" \
    > "$OUT/bench_host.log" 2>&1; tail -n 11 "$OUT/bench_host.log"
fi
if has zc; then
  timeout "${ZT:-150}" python3 experiments/bench_zero_copy.py --out "$OUT/bench_zero_copy.json" > "$OUT/bench_zero_copy.log" 2>&1
  tail -n 14 "$OUT/bench_zero_copy.log"
fi
if has jax; then
  timeout "${JT:-150}" python3 experiments/bench_jax_offload.py --params 268M --json "$OUT/bench_jax.json" > "$OUT/bench_jax.log" 2>&1
  tail -n 8 "$OUT/bench_jax.log"
  if [ -n "${JAX_GPT:-}" ]; then
    timeout "${JT:-150}" python3 experiments/bench_jax_offload.py --model "gpt:$JAX_GPT" --batch 8 --seq 1024 \
      --json "$OUT/bench_jax_gpt.json" > "$OUT/bench_jax_gpt.log" 2>&1; tail -n 6 "$OUT/bench_jax_gpt.log"
  fi
fi
if has train; then
  timeout "${TT:-400}" python3 experiments/bench_train.py ${TRAIN_ARGS:---configs 350m:8} --json "$OUT/bench_train.json" \
    > "$OUT/bench_train.log" 2>&1; grep -v '^{' "$OUT/bench_train.log" | tail -n 30
fi
if has jaxgpt; then
  timeout "${JGT:-500}" python3 experiments/bench_jax_gpt.py ${JAXGPT_ARGS:---sizes 1.3b,3b,7b} --json "$OUT/bench_jax_gpt.json" \
    > "$OUT/bench_jax_gpt.log" 2>&1; tail -n 22 "$OUT/bench_jax_gpt.log"
fi
if has largest; then
  LS=${LARGEST_STATE:-experiments/data/largest_model.json}
  mkdir -p "$(dirname "$LS")"
  timeout "${LT:-580}" python3 experiments/largest_model.py ${LARGEST_ARGS:---profiles 24g64} --budget "${LB:-540}" \
    --state "$LS" --log-dir /tmp/ts_largest_logs > "$OUT/largest_model.log" 2>&1; tail -n 40 "$OUT/largest_model.log"
  cp "$LS" "$OUT/largest_model.json"; tar czf "$OUT/largest_logs.tgz" -C /tmp ts_largest_logs
fi
if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then
  (cd "$OUT" && tar czf /tmp/ts_results.tgz --exclude=env.txt . && find . -mindepth 1 ! -name env.txt -delete && mv /tmp/ts_results.tgz results.tgz)
fi
