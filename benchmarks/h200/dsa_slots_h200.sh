#!/usr/bin/env bash
# Issue 17: DSA's selections as cache rows before the sparse attention (sparse_triton.slot_rows,
# an experiment off by default: MOESERVE_DSA_SLOT_ROWS=1; now in decode_gluon.sparse_gluon too:
# each tile's copies wait on one load, not a position load feeding a block-table load; sm90
# offline its loop 803 -> 655 instructions) on the H200, one call (~4 min): the GPU tests
# (the same bits), then kernels_dsa --decode-only without and with it (the sparse MLA alone:
# sparse_mla_ms against sparse_mla_gluon_slots_ms; DSA's decode step in a CUDA graph:
# dsa_graph_ms, pct_of_bound_graph). Results as $OUT/dsa_slots.tgz.
#   bash benchmarks/h200/dsa_slots_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/dsa_slots; mkdir -p $R
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_dsa_sparse_slots.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
dsa_decode_run default $R
dsa_decode_run slots $R MOESERVE_DSA_SLOT_ROWS=1
tar czf $OUT/dsa_slots.tgz -C /tmp dsa_slots
