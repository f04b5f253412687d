#!/usr/bin/env bash
# Issue 20's per-rank MoE tiles, tuned on ONE H200 before any multi-GPU call (so that no call
# on several GPUs spends minutes tuning): each CASE is one rank's routed-expert shape, its tuned
# file written under $OUT/moe_configs, to commit under moeserve/kernels/moe/configs/. Under EP a
# rank's entries are looked up at T x E_local / E tokens (tile_configs.tile_tokens), so its
# local shape's ordinary tune is the right one. Returned as one tarball, $OUT/rank_tiles.tgz.
#   bash benchmarks/h200/rank_tiles_h200.sh BUDGET_SECONDS_EACH CASE...
# CASE: qwen-tp2|qwen-tp4|qwen-tp8|qwen-ep2|qwen-ep4|qwen-ep8 (qwen3-30b-a3b bf16; part A),
#       glm5-nvfp4-tp8 (E 256, width 256) | glm5-nvfp4-ep8 (E 32, width 2,048) (part B),
#       bf16-PRESET | nvfp4-PRESET: a preset's whole expert shape on one GPU (issue 16's and
#       18's committed tiles; the shape from the preset's config, no model built, so presets
#       too large for one GPU tune too), e.g. bf16-glm-4.7-flash nvfp4-glm-5. A committed file
#       of the shape is resumed (the counts it lacks tuned) or kept.
# e.g. the 8-GPU runs first: bash benchmarks/h200/rank_tiles_h200.sh 100 glm5-nvfp4-tp8 \
#        glm5-nvfp4-ep8 qwen-tp8 qwen-ep8
set -uo pipefail
BUDGET=${1:?budget seconds per case}
shift
REAL_OUT=$OUT
export OUT=/tmp/rank_tiles
mkdir -p "$OUT/moe_configs"
source benchmarks/gpu_env.sh
# a committed file of the case's shape (PREFIX: its name up to the device) is copied into the
# tune's folder first, so a partial tune (a budget ran out) resumes and a whole one is kept
resume() {  # DIR PREFIX
  mkdir -p "$1"
  cp moeserve/kernels/moe/configs/"$2"* "$1/" 2>/dev/null && echo "resuming $(ls "$1")"
}
shape() {  # PRESET -> "E H I k" from its config
  python3 -c "from moeserve.config import load_model_config as m; \
c = m('$1')[0]; print(c.num_experts, c.hidden_size, c.moe_intermediate_size, \
c.num_experts_per_tok)"
}
for CASE in "$@"; do
  echo "== $CASE"
  case $CASE in
    qwen-tp*|qwen-ep*)
      N=${CASE#qwen-??}
      if [[ $CASE == qwen-tp* ]]; then SPLIT="--moe-tp $N"; else SPLIT="--ep $N"; fi
      # shellcheck disable=SC2086
      python3 -m benchmarks.kernels.kernels_moe --out "$OUT/$CASE" --preset qwen3-30b-a3b $SPLIT \
        --tune --tune-only --time-budget "$BUDGET" > "$OUT/$CASE.log" 2>&1; RC=$?
      cp "$OUT/$CASE"/configs/*.json "$OUT/moe_configs/" 2>/dev/null ;;
    glm5-nvfp4-tp8)
      resume "$OUT/moe_configs" "quant=nvfp4,E=256,H=6144,I=256,k=8,"
      python3 -m moeserve.kernels.moe.quant.tune --format nvfp4 -E 256 -H 6144 -I 256 -k 8 \
        --out "$OUT/moe_configs" --time-budget-s "$BUDGET" > "$OUT/$CASE.log" 2>&1; RC=$? ;;
    glm5-nvfp4-ep8)
      resume "$OUT/moe_configs" "quant=nvfp4,E=32,H=6144,I=2048,k=8,"
      python3 -m moeserve.kernels.moe.quant.tune --format nvfp4 -E 32 -H 6144 -I 2048 -k 8 \
        --out "$OUT/moe_configs" --time-budget-s "$BUDGET" > "$OUT/$CASE.log" 2>&1; RC=$? ;;
    bf16-*)
      read -r E H I _ <<< "$(shape "${CASE#bf16-}")"
      resume "$OUT/$CASE/configs" "E=$E,H=$H,I=$I,device_name=NVIDIA_H200,dtype=bfloat16,"
      python3 -m benchmarks.kernels.kernels_moe --out "$OUT/$CASE" --preset "${CASE#bf16-}" \
        --tune --tune-only --time-budget "$BUDGET" > "$OUT/$CASE.log" 2>&1; RC=$?
      cp "$OUT/$CASE"/configs/*.json "$OUT/moe_configs/" 2>/dev/null ;;
    nvfp4-*)
      # shellcheck disable=SC2046
      set -- $(shape "${CASE#nvfp4-}")
      resume "$OUT/moe_configs" "quant=nvfp4,E=$1,H=$2,I=$3,k=$4,"
      python3 -m moeserve.kernels.moe.quant.tune --format nvfp4 -E "$1" -H "$2" -I "$3" -k "$4" \
        --out "$OUT/moe_configs" --time-budget-s "$BUDGET" > "$OUT/$CASE.log" 2>&1; RC=$? ;;
    *) echo "unknown case $CASE" | tee -a "$OUT/errors.log"; continue ;;
  esac
  echo "rc $RC $(tail -1 "$OUT/$CASE.log")"
done
ls -la "$OUT/moe_configs"
tar czf "$REAL_OUT/moe_configs.tgz" -C "$OUT" moe_configs  # names with '=' and ',' come back only so
tar czf "$REAL_OUT/rank_tiles.tgz" -C /tmp rank_tiles
