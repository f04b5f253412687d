#!/usr/bin/env bash
# Issue 17: the radix top-k on the H200 in one call (up to ~10 minutes): its GPU tests (every
# form), the DSA kernel and tile tests, the compile-once checks, the MLA up-projected prefill's
# (test_mla.py), then, if they passed (the coop
# form's barriers: a hang or a wrong selection must not be timed), kernels_dsa --decode-only
# (the top-k's row, chunks (at 256-2,048 positions a program too) and coop forms eager and in
# CUDA graphs beside torch.topk, the row and chunks forms with topk_triton.GATHER; the decode
# step as one graph, with the coop top-k and with GATHER too: dsa_graph_coop_ms,
# dsa_graph_gather_ms) and kernels_dsa_prefill (W3's prefill chunk per layer: indexer, top-k, sparse
# MLA against dense MLA); kernels_dsa also times indexer_triton.score_key_tiles at 2-16, the
# scoring launch's warps and stages (SCORE_LAUNCHES) and the sparse MLA at TILES. Results as
# $OUT/dsa.tgz. Then kernels_dsa_prefill --pieces (the MLA prefill's piece kernels).
#   bash benchmarks/h200/topk_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/dsa; mkdir -p $R
# TOPK_TESTS=0 skips the tests (they passed at this commit in an earlier call); PREFILL=0
# skips kernels_dsa_prefill
if [ "${TOPK_TESTS:-1}" = 1 ]; then
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_dsa_topk_triton.py tests/kernels/attention/test_dsa_triton_gpu.py \
  tests/kernels/attention/test_dsa_triton_tiles.py tests/kernels/test_specialization_gpu.py \
  tests/kernels/attention/test_mla.py tests/kernels/attention/test_mla_piece_kernel.py \
  tests/kernels/attention/test_dsa_sparse_slots.py -k "dsa or mla or topk" > $R/gpu_tests_topk.log 2>&1
rc=$?
echo "tests rc=$rc"; tail -3 $R/gpu_tests_topk.log
if [ "$rc" != 0 ]; then tar czf $OUT/dsa.tgz -C /tmp dsa; exit 1; fi
fi
# TILES: the sparse MLA also at these tiles (default 32 heads a program: at 32 rows two head
# tiles halve each program's split partials)
timeout -s INT 230 python3 -m benchmarks.kernels.mla.kernels_dsa --out $R --decode-only \
  --tiles ${TILES:-32,64,8,3} > $R/kernels_dsa.log 2>&1
echo "kernels_dsa rc=$?"
python3 -c "
import json
for r in json.load(open('/tmp/dsa/kernels_dsa.json'))['decode']:
    print(r['case'], 'topk', r['topk_ms'], r['topk_graph_ms'], 'chunks', r['topk_chunks_ms'],
          r['topk_chunks_graph_ms'], r.get('topk_chunks_sizes_graph_ms'), 'coop',
          r.get('topk_coop_graph_ms'), r.get('dsa_graph_coop_ms'), 'gather',
          r.get('topk_gather_graph_ms'), r.get('dsa_graph_gather_ms'),
          r.get('dsa_graph_coop_gather_ms'), 'score launches',
          r.get('score_launch_ms'), r.get('dsa_graph_score_launch_ms'), 'torch', r['topk_torch_ms'],
          r['topk_torch_graph_ms'], 'score', r['score_ms'], 'sparse', r['sparse_mla_ms'],
          'step graph', r['dsa_graph_ms'], r['pct_of_bound_graph'], 'at the graph bound',
          r.get('graph_bound'), r.get('dsa_graph_bound_ms'), 'key tiles',
          r.get('score_key_tiles_ms'), r.get('dsa_graph_key_tiles_ms'), 'tiles',
          r.get('sparse_mla_tiles'))
"
if [ "${PREFILL:-1}" = 1 ]; then
timeout -s INT 200 python3 -m benchmarks.kernels.mla.kernels_dsa_prefill --out $R \
  > $R/kernels_dsa_prefill.log 2>&1
echo "kernels_dsa_prefill rc=$?"; cut -c1-400 $R/kernels_dsa_prefill.log
fi
# the up-projected prefill's piece kernels alone (flash, cuDNN, efficient at 20 / 64 / 128
# heads, 1,024 and 8,192 queries; their first call at new shapes): PIECES=0 skips it
if [ "${PIECES:-1}" = 1 ]; then
timeout -s INT 120 python3 -m benchmarks.kernels.mla.kernels_dsa_prefill --out $R/pieces \
  --pieces > $R/kernels_dsa_pieces.log 2>&1
echo "kernels_dsa_prefill --pieces rc=$?"; grep -E "^\{|piece_first_call" $R/kernels_dsa_pieces.log | cut -c1-300
fi
tar czf $OUT/dsa.tgz -C /tmp dsa
