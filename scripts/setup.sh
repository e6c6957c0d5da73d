#!/usr/bin/env bash
# Creates .venv (if missing) and installs TrainStream with its CPU test dependencies.
# torch==2.13.0 goes first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[torch,jax,test]"
