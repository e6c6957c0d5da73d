#!/usr/bin/env bash
# The wheels the GPU machine lacks, for scripts/gpu_run.sh (carry both folders: run's carry [".whl", ".whl_titan"]):
#   bash scripts/fetch_wheels.sh        (here, with the package index reachable; ~15 MB, a minute)
# .whl/: pytest-xdist, expecttest (torch's own optimizer inputs), torchao 0.17.0, DeepSpeed 0.19.8 (built here as a
# pure-Python wheel, DS_BUILD_OPS=0: its cpu_adam is compiled on the GPU machine) and the dependencies the image lacks.
# .whl_titan/: torchtitan 0.3.0 and its small dependencies (gpu_run.sh installs each only where the image lacks it).
# The image (Python 3.12, torch 2.11) has datasets, pyarrow, pandas, tensorboard, flax, optax, transformers, lightning
# (data/2026-12-07_r_h100/image_piplist.txt); torchtitan 0.3.0 still cannot import there (torch 2.11 lacks
# torch.distributed.fsdp.DataParallelMeshDims).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(realpath -s "${PY:-.venv/bin/python}")
get() {  # wheels for the GPU machine's Python 3.12 on x86-64 Linux, without their dependencies
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
    --no-deps -d "$@"
}
mkdir -p .whl .whl_titan
get .whl pytest-xdist execnet expecttest torchao==0.17.0 hjson ninja py-cpuinfo msgpack einops nvidia-ml-py \
  pydantic pydantic-core annotated-types typing-inspection
if ! ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
  tar xzf "$tmp"/deepspeed-0.19.8.tar.gz -C "$tmp"
  (cd "$tmp/deepspeed-0.19.8" && DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation \
    -w "$OLDPWD/.whl" .)
  rm -rf "$tmp"
fi
get .whl_titan torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 tyro==1.0.17 spmd_types==0.2.3 \
  docstring_parser typeguard shtab
du -sh .whl .whl_titan
