#!/usr/bin/env bash
# The main job on the built-in tiny-moe preset, on CPU, with no download: set up, then start
# `moeserve serve` and benchmark it with `moeserve bench` (a sweep over concurrency), ending with
# the table. Extra arguments go to `moeserve bench` (see `moeserve bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moeserve bench --preset tiny-moe --server-args "--device cpu" \
  --input-len 64 --output-len 64 --max-concurrency 4 16 64 "$@"
