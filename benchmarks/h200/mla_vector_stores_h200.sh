#!/usr/bin/env bash
# Issues 16 and 17: the Gluon MLA kernels' vector stores (decode_gluon.vector_stores, on by
# default since gpu_7c427c9/call3; the outputs stored in 16-byte vectors, 16 STG a thread at 64
# heads instead of 64; MOESERVE_MLA_VECTOR_STORES=0, set here for the plain forms, keeps the
# accumulator's stores) on the H200, one call (~5 min): the GPU
# tests (the same bits as the accumulator's stores), then kernels_mla: 20 heads gluon-swapped
# against gluon-swapped-vec, 64 and 128 heads gluon against gluon-vec (the issue's cases, W1's
# contexts among them, and --few-rows), then DSA's decode step without and with it.
# Results as $OUT/mla_vector_stores.tgz.
#   bash benchmarks/h200/mla_vector_stores_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/mla_vector_stores; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_gluon_vector_stores.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
timeout 90 env MOESERVE_MLA_VECTOR_STORES=0 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/h20 --heads 20 \
  --forms gluon-swapped gluon-swapped-vec > $R/kernels_mla_h20.log 2>&1
echo "kernels_mla 20 rc=$?"
timeout 100 env MOESERVE_MLA_VECTOR_STORES=0 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/h64 --heads 64 128 \
  --forms gluon gluon-vec > $R/kernels_mla_h64.log 2>&1
echo "kernels_mla 64/128 rc=$?"
timeout 60 env MOESERVE_MLA_VECTOR_STORES=0 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/few --heads 20 64 --few-rows \
  --forms gluon gluon-vec gluon-swapped gluon-swapped-vec > $R/kernels_mla_few.log 2>&1
echo "kernels_mla few rc=$?"
python3 -m benchmarks.kernels.mla.mla_cases_table $R/h20/kernels_mla.json $R/h64/kernels_mla.json \
  $R/few/kernels_mla.json
DSA_TIMEOUT=100 dsa_decode_run dsa_default $R MOESERVE_MLA_VECTOR_STORES=0
DSA_TIMEOUT=100 dsa_decode_run dsa_vec $R MOESERVE_MLA_VECTOR_STORES=1
tar czf $OUT/mla_vector_stores.tgz -C /tmp mla_vector_stores
