#!/usr/bin/env bash
# Set up .venv for moeserve on a fresh machine (idempotent): torch 2.13.0 first (the CPU build on
# local disk; a bare `torch` requirement would pull a CUDA build of several GB), then moeserve with
# its test extras, everything pinned by constraints.txt. Skips the installs when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.moeserve-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  echo "$want" > "$stamp"
fi
