#!/usr/bin/env bash
# Issue 18: the NVFP4 fused MoE's transposed tile (moe/quant/swapped_triton.py, an experiment
# off by default: MOESERVE_NVFP4_SWAP_AB=1) on the H200, one call (~3 min): its GPU tests, then
# kernels_quant's routed MoE layer in NVFP4 at qwen3-30b-a3b's and GLM-5's rank shapes, the
# committed tiles, without and with the switch. Results as $OUT/nvfp4_swap.tgz.
#   bash benchmarks/h200/nvfp4_swap_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/nvfp4_swap; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/moe/test_moe_quant_nvfp4_variants.py > $R/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -2 $R/gpu_tests.log
for variant in plain swapped; do
  vars=(); [ $variant = swapped ] && vars=(MOESERVE_NVFP4_SWAP_AB=1)
  mkdir -p $R/$variant
  timeout 150 env "${vars[@]}" python3 -m benchmarks.quant.kernels_quant --out $R/$variant \
    --no-linear --formats nvfp4 --shapes ${SHAPES:-qwen3-30b-a3b glm-5} > $R/$variant/kernels_quant.log 2>&1
  echo "kernels_quant $variant rc=$?"; tail -8 $R/$variant/kernels_quant.log
done
tar czf $OUT/nvfp4_swap.tgz -C /tmp nvfp4_swap
