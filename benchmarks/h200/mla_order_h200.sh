#!/usr/bin/env bash
# Issue 16: the Gluon MLA decode's rows launched longest context first
# (decode_gluon.longest_first, off by default). One program a row, launched in step order, the
# last wave of W1's mixed contexts (129-256 keys: three or four tiles a row) leaves SMs idle; a
# list-scheduling model puts the loss at 8-11% at 1,024 rows and 5-7% at 2,048, ~3% longest
# first. W1's contexts are where the 20-head bars miss (52.2 / 59.6% against 60%). One call
# (~4 min): the order's GPU tests (the same bits, eager and in a CUDA graph), then kernels_mla
# at every case and head count, "auto" (as served) against "auto-lf". $OUT/mla_order.tgz.
#   bash benchmarks/h200/mla_order_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/mla_order; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_longest_first.py > $R/gpu_tests.log 2>&1
rc=$?
echo "tests rc=$rc"; tail -3 $R/gpu_tests.log
if [ "$rc" = 0 ]; then
  timeout -s INT 360 python3 -m benchmarks.kernels.mla.kernels_mla --out $R --forms auto auto-lf \
    > $R/kernels_mla.log 2>&1
  echo "kernels_mla rc=$?"
  python3 -m benchmarks.kernels.mla.mla_cases_table $R/kernels_mla.json 2>/dev/null | head -60
fi
tar czf $OUT/mla_order.tgz -C /tmp mla_order
