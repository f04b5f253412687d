#!/usr/bin/env bash
# Issue 18: the 4-bit MoE tiles for the layout the engine serves. On CUDA the engine holds NVFP4
# / INT4 routed experts micro-tiled (micro_tiles.py), but the committed 4-bit files were tuned
# on the row layout before micro-tiles existed, and the grid now holds SUB_M tiles and the
# gated / down split (gpu_306980f/call1: SUB_M 5-22% faster from 16 rows an expert; no
# committed entry carries it). So each shape is tuned afresh, micro-tiled (the tuner's
# default where K fits), token counts by W1's need first, within TUNE_S seconds a shape
# (default 120; a tune cut short resumes from $OUT's ledger if it is carried back in). The
# files name the device they ran on (an H100's are read first on an H100, an H200's on an
# H200); commit $OUT/moe_configs/*.json under moeserve/kernels/moe/configs/ (the names come
# back in $OUT/moe_configs.tgz). JOBS picks a subset (default "glm5-nvfp4 qwen3-nvfp4
# glm47flash-nvfp4 glm5-int4").
#   bash benchmarks/h200/quant_micro_tiles_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=$OUT/moe_configs; mkdir -p "$dir"
[ -n "${RESUME_FROM:-}" ] && cp -v "$RESUME_FROM"/*.json "$dir"/
budget=${TUNE_S:-120}
counts="1024 256 64 512 2048 128 16 1 4096 8192"
for job in ${JOBS:-glm5-nvfp4 qwen3-nvfp4 glm47flash-nvfp4 glm5-int4}; do
  case $job in
    glm5-nvfp4) args="--format nvfp4 -E 256 -H 6144 -I 2048 -k 8";;
    glm5-int4) args="--format int4 -E 256 -H 6144 -I 2048 -k 8 --group 32";;
    qwen3-nvfp4) args="--format nvfp4 -E 128 -H 2048 -I 768 -k 8";;
    # glm-4.7-flash's routed experts (the committed rows file's shape)
    glm47flash-nvfp4) args="--format nvfp4 -E 64 -H 2048 -I 1536 -k 4";;
    *) echo "unknown job $job"; continue;;
  esac
  # shellcheck disable=SC2086
  timeout $(( budget + 40 )) python3 -m moeserve.kernels.moe.quant.tune $args --out "$dir" \
    --tokens $counts --time-budget-s "$budget" > "$OUT/tune_$job.log" 2>&1
  echo "$job rc=$?"; grep -E "best|budget" "$OUT/tune_$job.log" | tail -12
done
tar czf "$OUT/moe_configs.tgz" -C "$OUT" moe_configs
