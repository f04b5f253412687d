#!/usr/bin/env bash
# The radix top-k in DSA's decode step (issue 17), one call (~3 min on the H100):
#   bash benchmarks/h200/dsa_topk_h200.sh
# the top-k's GPU tests in every form (its one-launch "coop" form's barriers among them: a
# hang there must not eat the call, hence the timeout), then, if they passed, kernels_dsa
# --decode-only: the chunks form at 256 to 2,048 positions a program in CUDA graphs
# (topk_chunks_sizes_graph_ms), the coop form (topk_coop_graph_ms) and the step's graph with
# it (dsa_graph_coop_ms) beside the default's (dsa_graph_ms). Into $OUT/dsa_topk/.
# Session 39 (gpu_b8a5462/call2) ran it as dsa_topk_chunks_h200.sh: the chunk sizes, with
# mla_ws_graphs_h200.sh's prefill part after them.
set -uo pipefail
source benchmarks/gpu_env.sh
dir=$OUT/dsa_topk
mkdir -p "$dir"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_dsa_topk_triton.py > "$dir/gpu_tests_topk.log" 2>&1
rc=$?
echo "top-k gpu tests rc=$rc"; tail -3 "$dir/gpu_tests_topk.log"
[ "$rc" = 0 ] || exit 1
DSA_TIMEOUT=${DSA_TIMEOUT:-240} dsa_decode_run decode "$dir"
python3 -c "
import json
for r in json.load(open('$dir/decode/kernels_dsa.json'))['decode']:
    print(r['case'], 'top-k graph', r['topk_graph_ms'], 'chunks by size',
          r.get('topk_chunks_sizes_graph_ms'), 'coop', r.get('topk_coop_graph_ms'),
          'step graph', r['dsa_graph_ms'], r['pct_of_bound_graph'], 'with coop',
          r.get('dsa_graph_coop_ms'), 'bound', r['read_bound_ms'])"
