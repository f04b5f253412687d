#!/usr/bin/env bash
# Issue 18: quantized MoE tiles the committed files lack, most needed first:
#   1. GLM-5's FP8 experts (256 x 6,144 x 2,048, top 8): no file at all, so kernels_quant ran
#      the default tile (73.6 / 69.9% of the read bound at 64 / 256 tokens on an H100,
#      gpu_6b1031a/call3, against the 75% bar); the decode counts first.
#   2. qwen3-30b-a3b's (128 x 2,048 x 768, top 8) past 1,024 tokens (fp8 1-1,024, nvfp4 64 /
#      256 / 1,024 only), which W1's mixed steps reach (8,192 prefill tokens beside the decodes):
#      there the lookup takes 1,024's tile; nvfp4 also its missing decode counts.
# Each tune resumes from copies of the committed files (their ledgers kept) within TUNE_S
# seconds (default 150; a tune cut short resumes in a later call). Commit
# $OUT/moe_configs/*.json over moeserve/kernels/moe/configs/ (the names with '=' and ',' come
# back in $OUT/moe_configs.tgz). JOBS picks a subset (default "glm5-fp8 qwen3-fp8"). The 4-bit
# jobs (qwen3-nvfp4, qwen3-int4, kimi-int4) cannot resume the committed 4-bit files any more:
# those timed rows, the engine holds micro-tiles and a tune refuses a ledger of the other
# layout (quant/tune.py); quant_micro_tiles_h200.sh tunes them afresh.
#   bash benchmarks/h200/quant_tiles_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
# the tuned files name their device: an H200's are what the lookup there reads
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && [ "${FORCE:-0}" != 1 ]; then
  echo "not an H200: its tiles would be another device's files (FORCE=1 tunes anyway)"; exit 2
fi
dir=$OUT/moe_configs; mkdir -p "$dir"
cp moeserve/kernels/moe/configs/quant=* "$dir/"
budget=${TUNE_S:-150}
for job in ${JOBS:-glm5-fp8 qwen3-fp8}; do
  case $job in
    glm5-fp8) args="--format fp8 -E 256 -H 6144 -I 2048 -k 8"; tokens="64 256 1024 16 1 128 512 2048 8192";;
    qwen3-fp8) args="--format fp8 -E 128 -H 2048 -I 768 -k 8"; tokens="2048 4096 8192";;
    qwen3-nvfp4) args="--format nvfp4 -E 128 -H 2048 -I 768 -k 8"; tokens="2048 4096 8192 512 128 16 1";;
    # INT4 (group 32): BLOCK_K 64 tiles take the reshape decode, 128 the nibble planes
    qwen3-int4) args="--format int4 -E 128 -H 2048 -I 768 -k 8 --group 32"; tokens="64 256 1024 16 1 8192";;
    kimi-int4) args="--format int4 -E 384 -H 7168 -I 2048 -k 8 --group 32"; tokens="64 256 1024 16 1";;
    *) echo "unknown job $job"; continue;;
  esac
  # shellcheck disable=SC2086
  timeout $(( budget + 40 )) python3 -m moeserve.kernels.moe.quant.tune $args --out "$dir" \
    --tokens $tokens --time-budget-s "$budget" > "$OUT/tune_$job.log" 2>&1
  echo "$job rc=$?"; tail -3 "$OUT/tune_$job.log"
done
tar czf "$OUT/moe_configs.tgz" -C "$OUT" moe_configs
