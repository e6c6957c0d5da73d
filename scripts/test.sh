#!/usr/bin/env bash
# The test suite on a fresh machine: set up, then run pytest (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -ra "$@"
