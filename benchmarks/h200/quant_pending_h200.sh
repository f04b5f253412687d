#!/usr/bin/env bash
# Issue 18's GPU work left from session 47, in one call (a session gets one or two): within
# DEADLINE_S (default 560),
#   1. the quantized MoE's GPU tests, the micro-tiles', the W4A16 dequantize path's and
#      tests/quant (session 46's default change and loosened epilogue test not yet run whole:
#      session 47's run was cut off after 26 passed) -> gpu_tests.log (SIGINT at TESTS_S,
#      default 150: pytest still prints its summary)
#   2. W1 at 1,024 on glm-5 sliced to LAYERS (default 12 on an H100, 20 on an H200) in NVFP4
#      with the committed micro-layout tiles (session 45: 10,845 output tok/s with rows-era
#      tiles) -> qw1_glm5.tgz (glm_nvfp4_w1_h200.sh, W1_S seconds, default 200)
#   3. micro-layout tunes of the shapes still on defaults (JOBS, default "qwen3-nvfp4
#      glm47flash-nvfp4 glm5-int4") with what is left -> moe_configs.tgz: commit its files
#      under moeserve/kernels/moe/configs/
# W1=0 skips step 2; TEST_WORKERS (default 8) sets pytest's workers (the tests' time is mostly
# Triton compiles on the host's 16 cores).
#   bash benchmarks/h200/quant_pending_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  -n "${TEST_WORKERS:-8}" --durations=25 tests/kernels/moe/test_moe_quant_micro.py tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py \
  tests/kernels/moe/test_moe_quant_dequant.py tests/kernels/moe/test_moe_quant_lookup.py \
  tests/kernels/moe/test_moe_quant_tiles.py tests/kernels/moe/test_moe_quant_nvfp4_variants.py \
  tests/kernels/linear/test_w4a16_dequant.py tests/quant > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -8
if [ "${W1:-1}" = 1 ]; then
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then layers=20; else layers=12; fi
  LAYERS=${LAYERS:-$layers} FORMATS=nvfp4 BUDGET_S=${W1_S:-200} \
    bash benchmarks/h200/glm_nvfp4_w1_h200.sh glm5
fi
left=$(( ${DEADLINE_S:-560} - SECONDS ))
jobs=(${JOBS:-qwen3-nvfp4 glm47flash-nvfp4 glm5-int4})
if [ "$left" -gt 120 ]; then
  per=$(( (left - 20) / ${#jobs[@]} - 40 ))
  [ "$per" -lt 60 ] && { jobs=("${jobs[0]}"); per=$(( left - 60 )); }
  TUNE_S=$per JOBS="${jobs[*]}" bash benchmarks/h200/quant_micro_tiles_h200.sh
else
  echo "no time left for the tunes (${left}s)"
fi
