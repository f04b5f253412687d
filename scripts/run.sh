#!/usr/bin/env bash
# The main job on the built-in tiny-moe preset, on CPU, with no download: set up, then generate.
# Extra arguments go to `moeserve generate` (see `moeserve generate --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moeserve generate --preset tiny-moe --device cpu --num-prompts 16 \
  --max-tokens 64 --ignore-eos "$@"
