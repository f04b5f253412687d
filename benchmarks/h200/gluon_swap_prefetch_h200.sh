#!/usr/bin/env bash
# Issues 16 and 17: two Gluon MLA experiments, off by default, on the H200: the swapped decode
# (mla/decode_gluon_swapped.py: keys as wgmma's M, at most 32 heads; MOESERVE_MLA_DECODE_SWAPPED=1)
# and the block-table prefetch (each key tile's cache rows loaded an iteration ahead of its
# copies; decode_gluon's `prefetch`, MOESERVE_MLA_TABLE_PREFETCH=1). Three modes, one call
# each; results as $OUT/gluon_swap_prefetch.tgz.
#   bash benchmarks/h200/gluon_swap_prefetch_h200.sh kernels  # (~5 min) the GPU tests of both
#        # (and decode_gluon's, DSA's), then kernels_mla: at 20 heads gluon / gluon-prefetch /
#        # gluon-swapped-sync (the swap alone) / gluon-swapped (with its prefetch), at 64 and
#        # 128 heads gluon / gluon-prefetch (CASES, W1's contexts among them, and --few-rows)
#   bash benchmarks/h200/gluon_swap_prefetch_h200.sh dsa      # (~3 min) kernels_dsa
#        # --decode-only (DSA's decode step in a CUDA graph) without and with the prefetch
#   bash benchmarks/h200/gluon_swap_prefetch_h200.sh w1       # (~9 min) W1 on glm-4.7-flash at
#        # CONC (default 256 512 1024) through the server: VARIANTS (default "default unswapped
#        # prefetch"; also "fold": --fold-shared-experts) in turn at each concurrency
# (The swapped decode is the default since gpu_70a3760/call1; MOESERVE_MLA_DECODE_SWAPPED=0 is
# the A/B's other side.)
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/gluon_swap_prefetch; mkdir -p $R
case "${1:-kernels}" in
  kernels)
    timeout 240 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
      tests/kernels/attention/test_mla_decode_gluon_swapped.py \
      tests/kernels/attention/test_mla_gluon_prefetch.py \
      tests/kernels/attention/test_mla_decode_gluon.py \
      tests/kernels/attention/test_dsa_triton.py > $R/gpu_tests.log 2>&1
    echo "kernel tests rc=$?"; grep -E "passed|failed|Error" $R/gpu_tests.log | tail -8
    timeout 100 python3 -m benchmarks.kernels.kernels_mla --out $R/h20 --heads 20 \
      --forms gluon gluon-prefetch gluon-swapped-sync gluon-swapped > $R/kernels_mla_h20.log 2>&1
    echo "kernels_mla 20 rc=$?"; tail -2 $R/kernels_mla_h20.log
    timeout 100 python3 -m benchmarks.kernels.kernels_mla --out $R/h64 --heads 64 128 \
      --forms gluon gluon-prefetch > $R/kernels_mla_h64.log 2>&1
    echo "kernels_mla 64/128 rc=$?"; tail -2 $R/kernels_mla_h64.log
    timeout 60 python3 -m benchmarks.kernels.kernels_mla --out $R/few --heads 20 64 \
      --few-rows --forms gluon gluon-prefetch gluon-swapped > $R/kernels_mla_few.log 2>&1
    echo "kernels_mla few rc=$?"; tail -2 $R/kernels_mla_few.log
    python3 -m benchmarks.kernels.mla_cases_table $R/h20/kernels_mla.json \
      $R/h64/kernels_mla.json $R/few/kernels_mla.json ;;
  dsa)
    for variant in default prefetch; do
      env=(); [ $variant = prefetch ] && env=(MOESERVE_MLA_TABLE_PREFETCH=1)
      mkdir -p $R/dsa_$variant
      timeout -s INT 150 env "${env[@]}" python3 -m benchmarks.kernels.kernels_dsa \
        --out $R/dsa_$variant --decode-only > $R/dsa_$variant/kernels_dsa.log 2>&1
      echo "kernels_dsa $variant rc=$?"
      python3 -c "
import json
for r in json.load(open('$R/dsa_$variant/kernels_dsa.json'))['decode']:
    print('$variant', r['case'], 'sparse', r['sparse_mla_ms'], 'step graph', r['dsa_graph_ms'],
          r['pct_of_bound_graph'])"
    done ;;
  w1)
    for c in ${CONC:-256 512 1024}; do
      for variant in ${VARIANTS:-default unswapped prefetch}; do
        vars=(); [ $variant = unswapped ] && vars=(MOESERVE_MLA_DECODE_SWAPPED=0)
        [ $variant = prefetch ] && vars=(MOESERVE_MLA_TABLE_PREFETCH=1)
        [ $variant = fold ] && vars=(-- --fold-shared-experts)
        w1_run glm-4.7-flash "$c" "w1_c${c}_$variant" $R "${vars[@]}"
      done
    done
    gzip -f $R/*.jsonl ;;
esac
tar czf $OUT/gluon_swap_prefetch.tgz -C /tmp gluon_swap_prefetch
