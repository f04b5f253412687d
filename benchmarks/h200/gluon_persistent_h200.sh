#!/usr/bin/env bash
# Issue 16: the persistent Gluon MLA decode (mla/decode_gluon_persistent.py, an experiment off
# by default) and the Gluon prefill made default in session 26, on the H200. Two modes, each
# one call; results as $OUT/gluon_persistent.tgz.
#   bash benchmarks/h200/gluon_persistent_h200.sh kernels  # (~6 min) GPU tests: the persistent
#        # kernel, the Gluon decode / prefill, the MLA presets' bf16 agreement through the
#        # engine with the new defaults; kernels_mla gluon against gluon-persistent at 20 / 64 /
#        # 128 heads (CASES and --few-rows); mla_once's split counts at few rows
#   bash benchmarks/h200/gluon_persistent_h200.sh w1       # (~8 min) W1 on glm-4.7-flash at
#        # CONC (default 256 512 1024) through the server: the defaults, then
#        # MOESERVE_MLA_DECODE_PERSISTENT=1, then MOESERVE_MLA_PREFILL_GLUON=0, in turn at each
#        # concurrency (VARIANTS="default triton_prefill" picks among them)
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/gluon_persistent; mkdir -p $R
case "${1:-kernels}" in
  kernels)
    timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
      tests/kernels/attention/test_mla_decode_gluon_persistent.py \
      tests/kernels/attention/test_mla_decode_gluon.py > $R/gpu_tests.log 2>&1
    echo "kernel tests rc=$?"; grep -E "passed|failed|Error" $R/gpu_tests.log | tail -8
    timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -k mla \
      tests/engine/test_gpu_bf16_agreement.py > $R/gpu_tests_agreement.log 2>&1
    echo "agreement tests rc=$?"; tail -2 $R/gpu_tests_agreement.log
    timeout 150 python3 -m benchmarks.kernels.kernels_mla --out $R/cases --heads 20 64 128 \
      --forms gluon gluon-persistent > $R/kernels_mla.log 2>&1
    echo "kernels_mla rc=$?"
    timeout 60 python3 -m benchmarks.kernels.kernels_mla --out $R/few --heads 20 64 \
      --few-rows --forms gluon gluon-persistent > $R/kernels_mla_few.log 2>&1
    echo "kernels_mla few rc=$?"
    # split counts: the Gluon programs run one an SM, so decode_num_splits' two waves of
    # programs may cost a tail; one wave against the default at few rows (mla_once --splits)
    for case in "4|--kind sparse --batch 32 --context 8192" \
                "33|--kind dense --heads 20 --batch 4 --context 16384" \
                "4|--kind dense --heads 64 --batch 32 --context 4096"; do
      one_wave=${case%%|*}; args=${case#*|}  # splits that make 132 programs: one wave
      for s in "" "--splits $one_wave"; do
        timeout 60 python3 -m benchmarks.kernels.mla_once $args --gluon $s 2>>$R/once.err \
          | tail -1 | tee -a $R/mla_once.jsonl | cut -c1-200
      done
    done
    python3 -m benchmarks.kernels.mla_cases_table $R/cases/kernels_mla.json \
      $R/few/kernels_mla.json ;;
  w1)
    for c in ${CONC:-256 512 1024}; do
      for variant in ${VARIANTS:-default persistent triton_prefill}; do
        vars=(); [ $variant = persistent ] && vars=(MOESERVE_MLA_DECODE_PERSISTENT=1)
        [ $variant = triton_prefill ] && vars=(MOESERVE_MLA_PREFILL_GLUON=0)
        w1_run glm-4.7-flash "$c" "w1_c${c}_$variant" $R "${vars[@]}"
      done
    done
    gzip -f $R/*.jsonl ;;
esac
tar czf $OUT/gluon_persistent.tgz -C /tmp gluon_persistent
