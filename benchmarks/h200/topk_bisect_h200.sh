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
python3 - $OUT/kernels_dsa.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"no result: {e}")
for r in d["decode"]:
    print(r["case"], "topk graph auto", r.get("topk_graph_ms"), "bisect", r.get("topk_bisect_graph_ms"),
          "chunks", r.get("topk_chunks_graph_ms"), "| step graph", r.get("dsa_graph_ms"),
          "bisect", r.get("dsa_graph_bisect_ms"), "bound", r.get("read_bound_ms"),
          "pct", r.get("pct_of_bound_graph"))
PY
