#!/usr/bin/env bash
# The test suite on a fresh machine: set up, then run pytest (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -ra -n 2 --dist loadfile "$@"  # 2 workers (CI has 2 cores), a test file per worker
