#!/usr/bin/env bash
# The test suite on CPU (GPU tests are marked `gpu` and run on the GPU machine): set up, lint, test.
# pytest's exit 5 (no tests collected) fails this script like any other failure. The tests run in
# pytest-xdist workers, one a core up to 4 (PYTEST_XDIST_AUTO_NUM_WORKERS overrides; each worker
# imports torch and builds tiny models, ~1-2 GB); `-n 0` (or any -n given) after it wins.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check moeserve tests
cores=$(nproc 2>/dev/null || echo 2)
export PYTEST_XDIST_AUTO_NUM_WORKERS=${PYTEST_XDIST_AUTO_NUM_WORKERS:-$(( cores < 4 ? cores : 4 ))}
exec .venv/bin/python -m pytest -q -n auto "$@"
