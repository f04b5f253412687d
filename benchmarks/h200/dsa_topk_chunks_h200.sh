#!/usr/bin/env bash
# The radix top-k's chunk sizes in DSA's decode step (session 39, issue 17): kernels_dsa
# --decode-only, its chunks form at 256 to 2,048 positions a program in CUDA graphs
# (topk_chunks_sizes_graph_ms) beside the step's graph and the sparse MLA by decode_gluon_ws;
# then mla_ws_graphs_h200.sh's prefill part (decode_gluon.ws_sparse's prefill A/B). ~2.5 min
# on the H100 (gpu_b8a5462/call2, where the step also ran with the chunk halved while a launch
# had under 4 programs an SM: a policy since removed), into $OUT/dsa_topk/ and
# $OUT/mla_ws_graphs/:
#   bash benchmarks/h200/dsa_topk_chunks_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=$OUT/dsa_topk
mkdir -p "$dir"
DSA_TIMEOUT=${DSA_TIMEOUT:-240} dsa_decode_run decode "$dir"
python3 -c "
import json
for r in json.load(open('$dir/decode/kernels_dsa.json'))['decode']:
    print(r['case'], 'top-k chunks graph', r['topk_chunks_graph_ms'], 'by size',
          r.get('topk_chunks_sizes_graph_ms'), 'auto', r['topk_graph_ms'], 'step graph',
          r['dsa_graph_ms'], r['pct_of_bound_graph'], 'ws', r.get('dsa_graph_ws_ms'), 'bound',
          r['read_bound_ms'])"
bash benchmarks/h200/mla_ws_graphs_h200.sh prefill
