#!/usr/bin/env bash
# Issue 18: kernels/moe/quant/nvfp4_swapped.py (the NVFP4 fused MoE in Gluon with the tokens as
# wgmma's N) against the Triton tile, first GPU run. One call (~8 minutes):
#   1. the GPU tests of the quantized MoE (the swapped kernel's among them), the micro-tiles'
#      and the W4A16 linear's dequantize path -> gpu_tests.log
#   2. moe_quant_once: the looked-up tiles, the SUB_M default tiles and the swapped kernel at
#      row blocks of 16 / 32 / 64 and K steps of 64 / 128, micro-tiled as the engine holds
#      them, GLM-5's and qwen3-30b-a3b's experts at W1's token counts -> $OUT/swapped.jsonl
#   3. with what is left of DEADLINE_S (default 560), JOBS="glm5-nvfp4" micro-layout tunes
#      (quant_micro_tiles_h200.sh, TUNE_S 120) -> $OUT/moe_configs.tgz
#   bash benchmarks/h200/nvfp4_swapped_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 \
  tests/kernels/moe/test_moe_quant_nvfp4_variants.py tests/kernels/moe/test_moe_quant_micro.py \
  tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_dequant.py \
  tests/kernels/moe/test_moe_quant_lookup.py tests/kernels/moe/test_moe_quant_tiles.py \
  tests/kernels/linear/test_w4a16_dequant.py tests/quant > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
swapped=(--swapped 32 64 3 --swapped 32 128 3 --swapped 64 64 3 --swapped 16 64 3
         --swapped 32 64 4 --swapped 32 64 3 8)
cases=("glm-5 1024 --tile 64 128 128 4 3 8 1 --tile 32 64 128 4 3 1 1"
       "qwen3-30b-a3b 256 --tile 32 64 128 4 3 1 1 --tile 16 64 128 4 3 1"
       "qwen3-30b-a3b 1024 --tile 64 128 128 4 3 8 1 --tile 32 64 128 4 3 1 1"
       "glm-5 256 --tile 16 64 128 4 3 1"
       "glm-5 64 --tile 16 64 128 4 3 1"
       "qwen3-30b-a3b 64 --tile 16 64 128 4 3 1"
       "glm-5 2048 --tile 64 128 128 4 3 8 1")
for case in "${cases[@]}"; do
  [ $SECONDS -gt ${CASES_DEADLINE_S:-420} ] && { echo "stopped before $case (deadline)"; break; }
  read -r shape tokens tiles <<< "$case"
  # shellcheck disable=SC2086
  timeout 90 python3 -m benchmarks.quant.moe_quant_once --format nvfp4 --shape $shape \
    --tokens $tokens --weight-layout micro $tiles "${swapped[@]}" 2>>$OUT/swapped.log \
    | sed "s/^{/{\"case\": \"$shape $tokens\", /" | tee -a $OUT/swapped.jsonl
done
left=$(( ${DEADLINE_S:-560} - SECONDS ))
if [ $left -gt 100 ]; then
  TUNE_S=$(( left - 60 < 120 ? left - 60 : 120 )) JOBS=glm5-nvfp4 \
    bash benchmarks/h200/quant_micro_tiles_h200.sh
fi
