#!/usr/bin/env bash
# Tune a preset's fused-MoE tiles on the H200 and bring the file back to commit under
# moeserve/kernels/moe/configs/ (so that no fresh GPU machine spends its start-up tuning them):
# one engine start with the start-up tune's budget, the tuned file written to $OUT/moe_configs
# and packed as $OUT/moe_configs.tgz (the device tool leaves out names with '=' or ',').
#   bash benchmarks/h200/moe_tiles_h200.sh PRESET [BUDGET_SECONDS=400] [ENGINE FLAGS...]
# (engine flags that change the experts' shape, e.g. --fold-shared-experts: E + S experts)
set -uo pipefail
PRESET=${1:?preset}
BUDGET=${2:-400}
shift $(( $# < 2 ? $# : 2 ))
SITE=/tmp/site
[ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$SITE" .whl/*.whl
export PYTHONPATH=$PWD:$SITE MOESERVE_MOE_CONFIG_DIR=$OUT/moe_configs
mkdir -p "$MOESERVE_MOE_CONFIG_DIR"
python3 -m moeserve.cli generate --preset "$PRESET" --num-prompts 1 --max-tokens 4 \
  --moe-tune-budget-s "$BUDGET" "$@" --json-out "$OUT/capacity_$PRESET.json" 2>&1 | tail -30
ls -la "$MOESERVE_MOE_CONFIG_DIR"
# the files' names ("E=65,H=...") do not come back from $OUT as they are: a tarball does
tar czf "$OUT/moe_configs.tgz" -C "$OUT" moe_configs
