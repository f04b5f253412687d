#!/usr/bin/env bash
# Issue 18: the 4-bit MoE past decode sizes, where W1 at 1,024 streams spends its step. On an
# H100 GLM-5's micro-tiled NVFP4 experts took 4.13 ms at 1,024 tokens (43.9% of the read bound)
# against 1.80 at 64 (87.4%) with the tuned 64 x 128 tile (gpu_00d38f5/call2): at 32 rows an
# expert the weights are read about once whatever BLOCK_M, so the time is the tile's, not the
# stream's. The quantized tuner's grid never tried BLOCK_M 16 / 32 at 1,024 tokens (it takes the
# two largest of 16-128 within twice the rows an expert). One call (~4 minutes on an H100):
#   1. moe_quant_once --tile at 1,024 and 2,048 tokens, GLM-5's and qwen3-30b-a3b's experts
#      in NVFP4, micro-tiled as the engine holds them: BLOCK_M 16-128, GROUP_M 8 (consecutive
#      row blocks of an expert share each weight tile in L2) -> $OUT/large_m.jsonl
#   2. the decode step of glm-5 sliced to 12 layers in NVFP4 at 1,024 rows, part by part against
#      each part's bound (benchmarks/engine/profile_step.py) -> $OUT/profile/
# PROFILE_ONLY=1 runs part 2 alone (~2 minutes; ENGINE_ARGS: more engine arguments as JSON
# members, e.g. '"dequantize_linears": true'; TAG=_dl names its files; PRESET, default glm-5,
# LAYERS, default 12 (0: the preset's own) and BATCHES, default 1024, profile another model).
#   bash benchmarks/h200/quant_large_m_h200.sh
#   PROFILE_ONLY=1 PRESET=qwen3-30b-a3b LAYERS=0 BATCHES="256 1024" TAG=qwen3_dl \
#       ENGINE_ARGS='"dequantize_linears": true' bash benchmarks/h200/quant_large_m_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
tiles=(--tile 64 128 128 4 3 8 --tile 16 64 128 4 3 8 --tile 16 128 128 4 3 8
       --tile 32 64 128 4 3 8 --tile 32 128 128 4 3 8 --tile 64 64 128 4 3 8
       --tile 64 128 128 8 3 8 --tile 128 128 128 8 3 8 --tile 16 64 128 4 3 1)
cases=("glm-5 1024" "glm-5 2048" "qwen3-30b-a3b 1024" "qwen3-30b-a3b 2048")
[ "${PROFILE_ONLY:-0}" = 1 ] && cases=()
for case in "${cases[@]}"; do
  read -r shape tokens <<< "$case"
  timeout 150 python3 -m benchmarks.quant.moe_quant_once --format nvfp4 --shape $shape \
    --tokens $tokens --weight-layout micro "${tiles[@]}" 2>>$OUT/large_m.log \
    | sed "s/^{/{\"case\": \"$case nvfp4 micro\", /" | tee -a $OUT/large_m.jsonl
done
mkdir -p $OUT/profile
layers=${LAYERS:-12}
slice=()
[ "$layers" != 0 ] && slice=(--hf-overrides "{\"num_hidden_layers\": $layers}")
# shellcheck disable=SC2086
timeout 300 python3 -m benchmarks.engine.profile_step --preset "${PRESET:-glm-5}" \
  --batch ${BATCHES:-1024} "${slice[@]}" \
  --engine-args "{\"quantization\": \"nvfp4\", \"moe_tune_budget_s\": 0, \"max_model_len\": 4096${ENGINE_ARGS:+, $ENGINE_ARGS}}" \
  --tag "${TAG:-}" --out $OUT/profile > $OUT/profile/profile${TAG:+_$TAG}.log 2>&1
echo "profile_step rc=$?"; tail -40 $OUT/profile/profile${TAG:+_$TAG}.log
