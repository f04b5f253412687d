#!/usr/bin/env bash
# Issues 16 (and W1 at 2,048): the decode attention's rows launched longest context first
# (MOESERVE_DECODE_LONGEST_FIRST=1 / 0: decode_gluon.longest_first, paged_triton.longest_first;
# unset, the MLA decode's on, the GQA decode's off). One program a row, launched in step order, the last wave of W1's mixed
# contexts (129-256 keys: three or four 64-key tiles a row) leaves SMs idle; a
# list-scheduling model puts the loss at 8-11% at 1,024 rows and 5-7% at 2,048, ~3% longest
# first. W1's contexts are where the 20-head bars miss (52.2 / 59.6% against 60%). One call
# (~8 min): the order's GPU tests (the same bits, eager and in a CUDA graph), kernels_mla at
# every case and head count, "auto-so" (step order) against "auto" (as served: longest
# first, the MLA decode's default since gpu_8267862/call5), then W1 at CONC (default
# 1024) with the switch 0, 1, 1, 0 for each of PRESETS (default glm-4.7-flash) while the
# call has 240 s left (qwen3's GQA decode in another call: PRESETS=qwen3-30b-a3b KERNELS=0).
# $OUT/decode_order.tgz.
#   bash benchmarks/h200/decode_order_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/decode_order; mkdir -p $R
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_longest_first.py tests/engine/test_cuda_graphs.py \
  tests/kernels/attention/test_mla_piece_kernel.py > $R/gpu_tests.log 2>&1
rc=$?
echo "tests rc=$rc"; tail -3 $R/gpu_tests.log
if [ "$rc" = 0 ]; then
  if [ "${KERNELS:-1}" = 1 ]; then
    timeout -s INT 240 python3 -m benchmarks.kernels.mla.kernels_mla --out $R \
      --forms auto-so auto > $R/kernels_mla.log 2>&1
    echo "kernels_mla rc=$?"
    python3 -m benchmarks.kernels.mla.mla_cases_table $R/kernels_mla.json 2>/dev/null | head -60
  fi
  c=${CONC:-1024}
  for preset in ${PRESETS:-glm-4.7-flash}; do
    if [ $SECONDS -gt 330 ]; then echo "W1 $preset skipped: ${SECONDS}s gone"; continue; fi
    # A B B A: of two runs in a row the second was ~3% faster either way (gpu_43c198d), so
    # each switch runs once first and once second (ORDER_RUNS=2 keeps the first pair only)
    for run in so1:0 lf1:1 lf2:1 so2:0; do
      [ "${ORDER_RUNS:-4}" = 2 ] && [ "${run:2:1}" = 2 ] && continue
      w1_run $preset "$c" "w1_${preset}_c${c}_${run%%:*}" $R \
        MOESERVE_DECODE_LONGEST_FIRST=${run##*:}
    done
  done
fi
tar czf $OUT/decode_order.tgz -C /tmp decode_order
