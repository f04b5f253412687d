#!/usr/bin/env bash
# DSA's "bisect" top-k (kernels/attention/dsa/topk_bisect_triton.py: a program a token, the row
# in registers, the threshold bit by bit) on the GPU, one part of a call (~3 minutes):
#   1. the top-k's GPU tests in every form -> $OUT/topk_tests.log
#   2. kernels_dsa --decode-only at the rows it holds (CASES, default 32 and 256 tokens of 8k
#      positions): topk_bisect_graph_ms against the other forms, the step's graph with it
#      (dsa_graph_bisect_ms) against dsa_graph_ms -> $OUT/kernels_dsa.json
#   bash benchmarks/h200/topk_bisect_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout -s KILL ${TOPK_TESTS_TIMEOUT:-90} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_dsa_topk_triton.py > $OUT/topk_tests.log 2>&1
echo "topk GPU tests rc=$?: $(tail -1 $OUT/topk_tests.log)"
grep -E "^(FAILED|ERROR)" $OUT/topk_tests.log | head -5
timeout -s INT ${DSA_TIMEOUT:-150} python3 -m benchmarks.kernels.mla.kernels_dsa --out /tmp/kdsa \
  --decode-only --cases ${CASES:-decode_b32_ctx8k decode_b256_ctx8k} > $OUT/kernels_dsa.log 2>&1
echo "kernels_dsa rc=$?"
cp /tmp/kdsa/kernels_dsa.json $OUT/ 2>/dev/null
python3 -m benchmarks.kernels.json_rows $OUT/kernels_dsa.json decode case topk_graph_ms \
  topk_bisect_graph_ms topk_chunks_graph_ms dsa_graph_ms dsa_graph_bisect_ms read_bound_ms \
  pct_of_bound_graph
