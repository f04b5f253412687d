#!/usr/bin/env bash
# Issue 16: the swapped Gluon MLA decode with one key stage, two programs an SM
# (decode_gluon_swapped.one_stage, an experiment off by default:
# MOESERVE_MLA_SWAPPED_ONE_STAGE=1; sm90 offline 115,200 B of shared memory and 128 registers,
# no spill), on the H200, one call (~3 min): the swapped kernel's GPU tests (both forms against
# the dense expectation, fp16, chosen rows, a CUDA graph), then kernels_mla at 20 heads,
# gluon-swapped without and with it (the issue's cases and W1's contexts, where the two-stage
# kernel is at 48.8 / 52.9% of the bound at 1,024 / 2,048 rows, gpu_7c427c9/call3; the issue
# asks 60%); then its tokens form (decode_gluon_swapped.attend_tokens,
# MOESERVE_MLA_SWAPPED_TOKENS=1: a mixed step's absorbed attention as one launch, a program a
# token) in kernels_mla_prefill's glm-4.7-flash cases (absorbed_gluon_ms; W1's mixed step took
# 11.4 ms of prefill_gluon in 135, gpu_4705423/call1), with two stages and with one.
# Results as $OUT/swapped_one_stage.tgz. W1 with them: bash benchmarks/h200/w1_repeats_h200.sh
# DIR "default=" "one_stage=MOESERVE_MLA_SWAPPED_ONE_STAGE=1"
# "tokens=MOESERVE_MLA_SWAPPED_ONE_STAGE=1 MOESERVE_MLA_SWAPPED_TOKENS=1".
#   bash benchmarks/h200/swapped_one_stage_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/swapped_one_stage; mkdir -p $R
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_decode_gluon_swapped.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
for on in 0 1; do
  timeout 90 env MOESERVE_MLA_SWAPPED_ONE_STAGE=$on python3 -m benchmarks.kernels.kernels_mla \
    --out $R/one_stage$on --heads 20 --forms gluon-swapped > $R/kernels_mla_one_stage$on.log 2>&1
  echo "kernels_mla one_stage=$on rc=$?"
done
python3 -m benchmarks.kernels.mla_cases_table $R/one_stage0/kernels_mla.json \
  $R/one_stage1/kernels_mla.json
for v in "0 0" "1 0" "1 1"; do
  set -- $v
  timeout 100 env MOESERVE_MLA_SWAPPED_TOKENS=$1 MOESERVE_MLA_SWAPPED_ONE_STAGE=$2 \
    python3 -m benchmarks.kernels.kernels_mla_prefill --out $R/prefill_tokens$1_one_stage$2 \
    --presets glm-4.7-flash --gluon > $R/prefill_tokens$1_one_stage$2.log 2>&1
  echo "kernels_mla_prefill tokens=$1 one_stage=$2 rc=$?"
  grep -oE '"case": "[^"]*"|"absorbed_gluon_ms": [0-9.]+' \
    $R/prefill_tokens$1_one_stage$2/kernels_mla_prefill.json | paste -sd' '
done
tar czf $OUT/swapped_one_stage.tgz -C /tmp swapped_one_stage
