#!/usr/bin/env bash
# Around each call to the GPU machine from a development checkout (the device tool carries the
# working tree, 64 MiB at most, and benchmarks/results/ alone is larger):
#   bash benchmarks/gpu_call.sh prep   # GIT_COMMIT written (the results' provenance there),
#                                      # benchmarks/results/ left out of the working tree
#   bash benchmarks/gpu_call.sh done   # the whole tree back: before results are copied in
#                                      # or anything is committed
# Carry [".whl", "GIT_COMMIT"] with the call (benchmarks/gpu_wheels.sh fills .whl/).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prep)
    git rev-parse HEAD > GIT_COMMIT
    git sparse-checkout set --no-cone '/*' '!/benchmarks/results/'
    du -sh --exclude=.git --exclude=.venv . ;;
  done)
    git sparse-checkout disable
    rm -f GIT_COMMIT ;;
  *)
    sed -n 2,8p "$0"; exit 2 ;;
esac
