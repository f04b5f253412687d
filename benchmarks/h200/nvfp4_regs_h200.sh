#!/usr/bin/env bash
# Issue 18: kernels/moe/quant/nvfp4_regs.py (the NVFP4 fused MoE in Gluon with the decoded
# weights as wgmma's A operand in registers, over its mma byte order) against the Triton tile;
# its second form (session 48: the words, scales and X tiles through a cp.async ring of
# STAGES, each wgmma retired at once; the first, f396a81, raced), compiled offline only. One
# call (~5 minutes):
#   1. its GPU test (against the Triton tile, eager and in a CUDA graph) and the quantized
#      MoE's other variant tests -> gpu_tests.log
#   2. moe_quant_once: the looked-up tiles, the SUB_M tile and nvfp4_regs at row blocks of
#      16 / 32 / 64 (4 stages; also 6 at 16 / 32, 3 at 64), experts micro-tiled as the engine
#      holds them, GLM-5's and qwen3-30b-a3b's at W1's token counts -> $OUT/regs.jsonl (until
#      CASES_DEADLINE_S)
#   3. with what is left before DEADLINE_S (default 540): moe_quant_once --breakdown, the
#      looked-up op's per-kernel GPU times at qwen3-30b-a3b's and GLM-5's shapes, 64 / 256 /
#      1,024 tokens -> $OUT/breakdown.jsonl
#   bash benchmarks/h200/nvfp4_regs_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout -s INT -k 15 ${TESTS_S:-120} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/moe/test_moe_quant_nvfp4_variants.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -12
regs=(--regs 64 --regs 32 --regs 16 --regs 64 3 --regs 32 6 --regs 16 6)
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
for shape in qwen3-30b-a3b glm-5; do
  left=$(( ${DEADLINE_S:-540} - SECONDS ))
  [ "$left" -lt 40 ] && { echo "no time left for the $shape breakdown"; break; }
  timeout "$left" python3 -m benchmarks.quant.moe_quant_once --shape $shape --weight-layout micro \
    --calls 10 --breakdown 64 256 1024 >> $OUT/breakdown.jsonl 2>> $OUT/regs.log
done
cut -c1-400 $OUT/breakdown.jsonl
