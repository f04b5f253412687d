#!/usr/bin/env bash
# Issue 16: the swapped Gluon MLA decode walking rows as one stream of key tiles, a program an
# SM (decode_gluon_swapped.persistent_rows, an experiment off by default:
# MOESERVE_MLA_SWAPPED_ROWS=1), on the H200, one call (~3 min): its GPU tests (the unsplit
# kernel's bits), then kernels_mla at 20 heads, gluon-swapped without and with it (the issue's
# cases and W1's contexts, where a row's 3-4 tiles leave its prologue exposed: 48.8 / 52.9% of
# the bound at 1,024 / 2,048 rows, gpu_7c427c9/call3). Unsplit launches only take it: the
# default split count gives W1's contexts and most 1k-4k cases one partition a row. Results as
# $OUT/swapped_rows.tgz. W1 with it: bash benchmarks/h200/w1_repeats_h200.sh DIR "default="
# "rows=MOESERVE_MLA_SWAPPED_ROWS=1".
#   bash benchmarks/h200/swapped_rows_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/swapped_rows; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_decode_gluon_swapped.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
for on in 0 1; do
  timeout 90 env MOESERVE_MLA_SWAPPED_ROWS=$on python3 -m benchmarks.kernels.kernels_mla \
    --out $R/rows$on --heads 20 --forms gluon-swapped > $R/kernels_mla_rows$on.log 2>&1
  echo "kernels_mla rows=$on rc=$?"
done
python3 -m benchmarks.kernels.mla_cases_table $R/rows0/kernels_mla.json $R/rows1/kernels_mla.json
tar czf $OUT/swapped_rows.tgz -C /tmp swapped_rows
