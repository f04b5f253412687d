#!/usr/bin/env bash
# Issue 16: the swapped Gluon MLA decode (mla/decode_gluon_swapped.py: keys as wgmma's M, at
# most 32 heads, an experiment off by default) on the H200. Two modes, each one call; results
# as $OUT/gluon_swapped.tgz.
#   bash benchmarks/h200/gluon_swapped_h200.sh kernels  # (~4 min) its GPU tests (and
#        # decode_gluon's), then kernels_mla gluon against gluon-swapped-sync (the swap alone)
#        # and gluon-swapped (with its block-table prefetch) at 20 heads (CASES, W1's contexts
#        # among them, and --few-rows)
#   bash benchmarks/h200/gluon_swapped_h200.sh w1       # (~6 min) W1 on glm-4.7-flash at CONC
#        # (default 256 512 1024) through the server: the defaults, then
#        # MOESERVE_MLA_DECODE_SWAPPED=1, in turn at each concurrency
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/gluon_swapped; mkdir -p $R
case "${1:-kernels}" in
  kernels)
    timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
      tests/kernels/attention/test_mla_decode_gluon_swapped.py \
      tests/kernels/attention/test_mla_decode_gluon.py > $R/gpu_tests.log 2>&1
    echo "kernel tests rc=$?"; grep -E "passed|failed|Error" $R/gpu_tests.log | tail -8
    timeout 120 python3 -m benchmarks.kernels.kernels_mla --out $R/cases --heads 20 \
      --forms gluon gluon-swapped-sync gluon-swapped > $R/kernels_mla.log 2>&1
    echo "kernels_mla rc=$?"; tail -3 $R/kernels_mla.log
    timeout 60 python3 -m benchmarks.kernels.kernels_mla --out $R/few --heads 20 \
      --few-rows --forms gluon gluon-swapped-sync gluon-swapped > $R/kernels_mla_few.log 2>&1
    echo "kernels_mla few rc=$?"; tail -3 $R/kernels_mla_few.log
    python3 -m benchmarks.kernels.mla_cases_table $R/cases/kernels_mla.json \
      $R/few/kernels_mla.json ;;
  w1)
    for c in ${CONC:-256 512 1024}; do
      for variant in default swapped; do
        env=(); [ $variant = swapped ] && env=(MOESERVE_MLA_DECODE_SWAPPED=1)
        timeout 110 env "${env[@]}" python3 -m moeserve.cli bench --preset glm-4.7-flash \
          --max-concurrency "$c" --no-progress --output-json "$R/w1_c${c}_$variant.jsonl" \
          > "$R/w1_c${c}_$variant.log" 2>&1
        echo "c=$c $variant rc=$?"
        grep -E "Output token throughput|eager decode|serial roofline" "$R/w1_c${c}_$variant.log"
      done
    done
    gzip -f $R/*.jsonl ;;
esac
tar czf $OUT/gluon_swapped.tgz -C /tmp gluon_swapped
