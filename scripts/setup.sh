#!/usr/bin/env bash
# Set up .venv for moeserve on a fresh machine (idempotent): torch 2.13.0 first (the CPU build on
# local disk; a bare `torch` requirement would pull a CUDA build of several GB), then moeserve with
# its test extras, everything pinned by constraints.txt. Skips the installs when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.moeserve-setup
# The GPU machine's Triton beside this one, in a folder of its own (not importable unless put
# on PYTHONPATH): tests/kernels/test_sm90_codegen.py puts every kernel, Gluon's included (whose
# API moves between releases), through that release's sm90 code generation and ptxas.
GPU_TRITON=3.6.0
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  rm -rf .venv/gpu-triton
  .venv/bin/python -m pip install -q --no-deps --target .venv/gpu-triton "triton==$GPU_TRITON"
  echo "$want" > "$stamp"
fi
