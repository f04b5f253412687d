#!/usr/bin/env bash
# Issue 17 on the H200: DSA's GPU tests and kernel timings in one call (~5 minutes); the logs
# and JSON come back as $OUT/dsa.tgz (a call returns at most 8 files).
#   bash benchmarks/h200/dsa_h200.sh
# 1. pytest -m gpu over the DSA kernel files (the packed loop, slot_rows, the radix top-k), the
#    DSA engine file (the decode graphs by context bound, captured for real), the CUDA-graph
#    file and the kernels' compile-once checks;
# 2. kernels_dsa --decode-only: the decode step per layer at GLM-5's shape against its read
#    bound (eager, and as one CUDA graph), the radix top-k against torch.topk, with
#    sparse_mla_slots_ms (the slot_rows switch) and, given TILES (e.g. "64,32,8,3 64,64,8,2"),
#    the sparse MLA at those tiles.
# Then W1's parity on the slice is benchmarks/h200/w1_dsa_slice_h200.sh (a call of its own).
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/dsa
mkdir -p "$R"
timeout 240 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_dsa_triton_gpu.py tests/kernels/attention/test_dsa_triton_tiles.py \
  tests/kernels/attention/test_dsa_sparse_slots.py tests/kernels/attention/test_dsa_topk_triton.py \
  tests/engine/test_dsa_families_vs_hf.py tests/engine/test_cuda_graphs.py \
  tests/kernels/test_specialization_gpu.py > "$R/gpu_tests_dsa.log" 2>&1
echo "dsa gpu tests rc=$?"; tail -2 "$R/gpu_tests_dsa.log"
timeout -s INT 240 python3 -m benchmarks.kernels.mla.kernels_dsa --out "$R" --decode-only \
  ${TILES:+--tiles $TILES} > "$R/kernels_dsa.log" 2>&1
echo "kernels_dsa rc=$?"
python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['decode']:
    print(r['case'], 'indexer', r['indexer_ms'], 'topk', r['topk_ms'], 'torch', r['topk_torch_ms'],
          'graph', r['dsa_graph_ms'], r['pct_of_bound_graph'], 'sparse', r['sparse_mla_ms'], 'slots',
          r.get('sparse_mla_slots_ms'), 'tiles', r.get('sparse_mla_tiles'), 'dense',
          r['dense_mla_ms'], 'pct', r['pct_of_bound'])
" "$R/kernels_dsa.json"
tar czf "$OUT/dsa.tgz" -C /tmp dsa
