#!/usr/bin/env bash
# Issue 17: where DSA's decode step at 32 rows of 8k positions spends its time (0.111 ms in a
# CUDA graph on an H100 against a 0.0475 ms read bound, gpu_a8d729a/call2): Nsight Compute over
# every kernel of one step (the indexer's scores, the bisect top-k, the sparse MLA and its
# split's combine), each against its own bytes. One call (~5 minutes with the tests and
# timings below; ~2 with NO_TIMINGS=1; NO_NCU=1 skips the profile) -> $OUT/ncu_dsa.tgz and
# the details page's key lines printed.
#   bash benchmarks/h200/dsa_step_ncu_h200.sh         # BATCH=32 CONTEXT=8192
# First (unless NO_TIMINGS=1): the GPU tests of the indexer, the top-k in every form (the
# bisect form's own too), the warp-specialized MLA decode (its sparse form), the DSA families
# against transformers under "auto"'s bisect top-k and the indexer's and top-k's compile-once
# count, the split partials' every writer (-> $OUT/dsa_tests.log; TESTS_TIMEOUT), and
# kernels_dsa's 32 and 256 x 8k cases with the bisect warps, the sparse MLA's splits, its
# forms and the split partials' forms swept (-> $OUT/kernels_dsa.json).
set -uo pipefail
source benchmarks/gpu_env.sh
if [ -z "${NO_TIMINGS:-}" ]; then
  timeout -s KILL ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
    tests/kernels/attention/test_dsa_triton_gpu.py tests/kernels/attention/test_dsa_topk_triton.py \
    tests/kernels/attention/test_dsa_topk_bisect.py tests/kernels/attention/test_mla_decode_gluon_ws.py \
    tests/kernels/attention/test_mla_split_partials.py tests/kernels/attention/test_dsa_indexer_rope.py \
    tests/engine/test_dsa_families_vs_hf.py \
    tests/kernels/test_specialization_gpu.py::test_dsa_indexer_compiles_once_across_batch_shapes \
    > $OUT/dsa_tests.log 2>&1
  echo "dsa GPU tests rc=$?: $(tail -1 $OUT/dsa_tests.log)"
  grep -E "^(FAILED|ERROR)" $OUT/dsa_tests.log | head -5
  timeout -s INT ${DSA_TIMEOUT:-200} python3 -m benchmarks.kernels.mla.kernels_dsa \
    --out /tmp/kdsa --decode-only --cases ${DSA_CASES:-decode_b32_ctx8k decode_b256_ctx8k} \
    > $OUT/kernels_dsa.log 2>&1
  echo "kernels_dsa rc=$?"
  cp /tmp/kdsa/kernels_dsa.json $OUT/ 2>/dev/null
  python3 -m benchmarks.kernels.json_rows $OUT/kernels_dsa.json decode case dsa_graph_ms \
    read_bound_ms topk_graph_ms score_ms topk_bisect_warps_graph_ms \
    topk_bisect_warps_wide_graph_ms sparse_mla_splits_ms dsa_graph_splits_ms sparse_mla_ws_ms \
    dsa_graph_ws_ms sparse_mla_ws_slots_ms dsa_graph_ws_slots_ms dsa_graph_ws2_ms \
    dsa_graph_ws2_slots_ms sparse_mla_reduce_ms dsa_graph_reduce_ms indexer_rope_graph_ms \
    dsa_graph_bound_ms dsa_graph_pdl_ms topk_bisect_align_rows_graph_ms gather_rate_tbs \
    dsa_graph_halves_ms dsa_graph_two_streams_ms \
    topk_bisect_align_rows_wide_graph_ms
fi
[ -n "${NO_NCU:-}" ] && exit 0  # NO_NCU=1: the tests and timings alone
dir=/tmp/ncu_dsa; mkdir -p $dir
python3 -m benchmarks.kernels.mla.dsa_step_once --batch ${BATCH:-32} --context ${CONTEXT:-8192} \
  --calls 20 | tee $dir/step.json
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
# shellcheck disable=SC2086
NCU_ALL=1 ncu_profile $dir ncu_dsa_b${BATCH:-32} ${NCU_TIMEOUT:-150} \
  "^  [_a-zA-Z]|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Registers Per|Grid Size|Block Size|Achieved Occupancy|Issued Ipc" \
  --clock-control none -c 12 $sections \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,lts__t_bytes.sum.per_second" -- \
  python3 -m benchmarks.kernels.mla.dsa_step_once --batch ${BATCH:-32} --context ${CONTEXT:-8192} --calls 1
rm -f $dir/*.ncu-rep
grep -E "^  [_a-zA-Z]|dram__bytes_read.sum |stalled_(long_scoreboard|barrier|wait|short_scoreboard|math|mio|lg_throttle)" \
  $dir/ncu_dsa_b${BATCH:-32}_all.txt | head -60
tar czf $OUT/ncu_dsa.tgz -C /tmp ncu_dsa
