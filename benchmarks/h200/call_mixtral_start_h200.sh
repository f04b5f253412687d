#!/usr/bin/env bash
# One GPU call (session 13): #18's quantized-kernel GPU tests and kernel timings on the code
# changed since they last ran, then #13's mixtral-8x7b study begun: its H200 MoE tiles tuned
# (to commit) and used by the first trials of the tune from the engine's defaults. Everything
# is written under /tmp/callB and returned as one tarball, $OUT/callB.tgz.
#   bash benchmarks/h200/call_mixtral_start_h200.sh [SECONDS=585]
set -uo pipefail
LIMIT=${1:-585}
REAL_OUT=$OUT
export OUT=/tmp/callB
mkdir -p "$OUT"
GPU_ENV_VERSIONS=optuna source benchmarks/gpu_env.sh
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py tests/kernels/moe/test_moe_quant_nvfp4_variants.py \
  tests/kernels/linear/test_quant_linear_triton.py \
  tests/kernels/linear/test_fp8_linear_triton.py tests/kernels/linear/test_fp8_linear_cublas.py \
  tests/kernels/moe/test_moe_quant_tune.py > "$OUT/gpu_tests_quant.log" 2>&1
tail -3 "$OUT/gpu_tests_quant.log"
timeout 120 python3 -m benchmarks.quant.kernels_quant --out "$OUT" --no-linear --formats fp8 nvfp4 \
  --shapes qwen3-30b-a3b --nvfp4-decode bits asm --profile > "$OUT/kernels_quant.log" 2>&1
tail -12 "$OUT/kernels_quant.log"
timeout 240 bash benchmarks/h200/moe_tiles_h200.sh mixtral-8x7b 150 > "$OUT/mixtral_tiles.log" 2>&1
tail -4 "$OUT/mixtral_tiles.log"
export MOESERVE_MOE_CONFIG_DIR=$OUT/moe_configs
LEFT=$((LIMIT - SECONDS - 10))
if [ "$LEFT" -gt 150 ]; then
  PRESET=mixtral-8x7b START= STUDY=mixtral-c1024-defaults \
    SRC=benchmarks/results/tune_mixtral_c1024/tune.db \
    bash benchmarks/h200/tune_h200.sh search auto 0 "$LEFT" | tail -15
fi
tar czf "$REAL_OUT/callB.tgz" -C /tmp callB
