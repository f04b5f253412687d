#!/usr/bin/env bash
# The test suite on CPU (GPU tests are marked `gpu` and run on the GPU machine): set up, lint, test.
# pytest's exit 5 (no tests collected) fails this script like any other failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check moeserve tests
exec .venv/bin/python -m pytest -q "$@"
