#!/usr/bin/env bash
# Issue 18: the micro-tiled NVFP4 dequantize read as int32 words (ccb1399; offline sm90: 424
# SASS instructions and 7 loads a thread against 520 and 19) on the GPU: its GPU test, then the
# NVFP4 MoE dequantized first at 8,192 tokens (every expert dequantized, then the bf16 fused
# MoE: the path of W1's mixed steps), micro-tiled experts, with the op's kernels by GPU time
# (--profile: the dequantize launch on its own; session 49's step profile had 0.63 ms a layer
# at qwen3-30b-a3b, ~73% of its bound). ~3 minutes, then `pytest -m gpu` over the tree's
# part PART (default 2/3) in what is left of the call.
#   bash benchmarks/h200/dequant_words_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/moe/test_moe_quant_micro.py \
  > $OUT/dequant_test.log 2>&1
echo "dequant GPU test: $(tail -1 $OUT/dequant_test.log)"
timeout -s INT 200 python3 -m benchmarks.quant.kernels_quant --out $OUT/dequant --formats nvfp4 \
  --no-linear --tokens 8192 --moe-dequant on off --weight-layout micro --profile \
  > $OUT/dequant_kq.log 2>&1
echo "kernels_quant rc=$?"; grep -iE "dequant|pct|ms" $OUT/dequant_kq.log | tail -20
left=$(( 560 - SECONDS ))
echo "gpu tests part ${PART:-2/3} with ${left} s"
[ "$left" -gt 60 ] && GPU_TESTS_TIMEOUT=$left bash benchmarks/h200/gpu_tests_h200.sh "${PART:-2/3}"
