#!/usr/bin/env bash
# Issue 18: kernels/moe/quant/nvfp4_regs.py (the NVFP4 fused MoE in Gluon with the decoded
# weights as wgmma's A operand in registers, over its mma byte order; written in session 47,
# compiled offline only) against the Triton tile, first GPU run. One call (~5 minutes):
#   1. its GPU test (against the Triton tile, eager and in a CUDA graph) and the quantized
#      MoE's other variant tests -> gpu_tests.log
#   2. moe_quant_once: the looked-up tiles, the SUB_M tile and nvfp4_regs at row blocks of
#      16 / 32 / 64 (4 stages; 3 at 32), experts micro-tiled as the engine holds them, GLM-5's
#      and qwen3-30b-a3b's at W1's token counts -> $OUT/regs.jsonl (until CASES_DEADLINE_S)
#   bash benchmarks/h200/nvfp4_regs_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout -s INT -k 15 ${TESTS_S:-120} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/moe/test_moe_quant_nvfp4_variants.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
regs=(--regs 32 --regs 64 --regs 16 --regs 32 3)
cases=("glm-5 1024 --tile 64 128 128 4 3 8 1"
       "glm-5 64 --tile 16 64 128 4 3 1"
       "qwen3-30b-a3b 256 --tile 32 64 128 4 3 1 1"
       "qwen3-30b-a3b 1024 --tile 64 128 128 4 3 8 1"
       "glm-5 256 --tile 16 64 128 4 3 1"
       "qwen3-30b-a3b 64 --tile 16 64 128 4 3 1"
       "glm-5 2048 --tile 64 128 128 4 3 8 1")
for case in "${cases[@]}"; do
  [ $SECONDS -gt ${CASES_DEADLINE_S:-400} ] && { echo "stopped before $case (deadline)"; break; }
  read -r shape tokens tiles <<< "$case"
  # shellcheck disable=SC2086
  timeout 90 python3 -m benchmarks.quant.moe_quant_once --format nvfp4 --shape $shape \
    --tokens $tokens --weight-layout micro $tiles "${regs[@]}" 2>>$OUT/regs.log \
    | sed "s/^{/{\"case\": \"$shape $tokens\", /" | tee -a $OUT/regs.jsonl
done
