#!/usr/bin/env bash
# Issue 18: the 4-bit MoE at 512-2,048 tokens with the SUB_M option (a 64- or 128-row block
# whose real rows fit a half or a quarter of it computes that tile: mma.sync's register
# operands at 16 / 32 rows, no stores of the decoded tile to shared memory). At 1,024 tokens
# GLM-5's experts hold ~32 rows each, so about half of the 64-row blocks would take the 32-row
# tile with each expert's weights still decoded once; at 256 tokens qwen3-30b-a3b's hold ~16,
# where 16-row blocks decode the weights of about 4 experts in 10 twice and 32-row blocks with
# SUB_M would not. One call (~6 minutes on an H100):
#   1. the GPU tests of the quantized MoE (SUB_M's included), of the micro-tiled experts and of
#      the W4A16 linear's dequantize path (written in session 45, not yet run) -> gpu_tests.log
#   2. moe_quant_once --tile with and without SUB_M, NVFP4 and INT4 micro-tiled as the engine
#      holds them, GLM-5's and qwen3-30b-a3b's experts, and gated 64-wide tiles beside a
#      128-wide down launch (--down-n 128: the 64 x 128 gated tile spills, 64 x 64 does not)
#      -> $OUT/sub_m.jsonl
#   bash benchmarks/h200/sub_m_quant_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/moe/test_moe_quant_micro.py tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py \
  tests/kernels/moe/test_moe_quant_dequant.py tests/kernels/linear/test_w4a16_dequant.py \
  tests/quant > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
tiles=(--tile 64 128 128 4 3 8 --tile 64 128 128 4 3 8 1 --tile 64 64 128 4 3 8
       --tile 64 64 128 4 3 8 1 --tile 128 128 128 8 3 8 --tile 128 128 128 8 3 8 1
       --tile 16 64 128 4 3 1 --tile 32 64 128 4 3 1 --tile 32 64 128 4 3 1 1)
cases=("glm-5 1024 nvfp4" "qwen3-30b-a3b 256 nvfp4" "qwen3-30b-a3b 1024 nvfp4"
       "glm-5 1024 int4" "glm-5 512 nvfp4" "qwen3-30b-a3b 512 nvfp4" "glm-5 2048 nvfp4"
       "qwen3-30b-a3b 2048 nvfp4" "qwen3-30b-a3b 1024 int4")
split=(--down-n 128 --tile 64 64 128 4 3 8 --tile 64 64 128 4 3 8 1 --tile 128 64 128 8 3 8
       --tile 32 64 128 4 3 1 1)
for case in "${cases[@]}"; do
  [ $SECONDS -gt ${DEADLINE_S:-480} ] && { echo "stopped before $case (deadline)"; break; }
  read -r shape tokens fmt <<< "$case"
  timeout 100 python3 -m benchmarks.quant.moe_quant_once --format $fmt --shape $shape \
    --tokens $tokens --weight-layout micro "${tiles[@]}" 2>>$OUT/sub_m.log \
    | sed "s/^{/{\"case\": \"$case micro\", /" | tee -a $OUT/sub_m.jsonl
  timeout 60 python3 -m benchmarks.quant.moe_quant_once --format $fmt --shape $shape \
    --tokens $tokens --weight-layout micro "${split[@]}" 2>>$OUT/sub_m.log \
    | sed "s/^{/{\"case\": \"$case micro split\", /" | tee -a $OUT/sub_m.jsonl
done
