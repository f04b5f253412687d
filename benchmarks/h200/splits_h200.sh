#!/usr/bin/env bash
# Issues 16/17: the MLA decode's partition count and split reduce on the H200 (one call, about
# 7 minutes): absorbed_triton.decode_num_splits now aims at two programs an SM (it took the GQA
# rule's 1,024 programs: 4 partitions at 256 rows, where the A/B in gpu_039305d/call2 measured
# one partition 1.7x faster), and the reduce loops over the splits (it read a masked block of
# all 64). 1. the MLA / DSA kernel GPU tests; 2. mla_once's A/B again (the default partitions
# against forced ones); 3. kernels_dsa --decode-only with the sparse tile (64,64,8,2);
# 4. kernels_mla at 20, 64 and 128 heads at the default tiles. $OUT/splits.tgz.
#   bash benchmarks/h200/splits_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/splits; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_triton.py tests/kernels/attention/test_dsa_triton_gpu.py \
  > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
once() { timeout 90 python3 -m benchmarks.kernels.mla.mla_once "$@" 2>>$R/once.err | tail -1 | tee -a $R/mla_ab.jsonl; }
once --kind sparse --batch 256 --context 8192
once --kind sparse --batch 256 --context 8192 --splits 4
once --kind sparse --batch 32 --context 65536
once --kind sparse --batch 128 --context 32768
once --kind dense --batch 256 --context 2048
once --kind dense --batch 256 --context 2048 --splits 4
once --kind dense --batch 32 --context 65536
once --kind dense --batch 32 --context 65536 --splits 32
timeout -s INT 200 python3 -m benchmarks.kernels.mla.kernels_dsa --out $R --decode-only \
  --tiles 64,64,8,2 > $R/kernels_dsa.log 2>&1
echo "kernels_dsa rc=$?"
python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['decode']:
    print(r['case'], 'score', r['score_ms'], 'topk graph', r['topk_graph_ms'], 'sparse', r['sparse_mla_ms'],
          'tiles', r.get('sparse_mla_tiles'), 'step graph', r['dsa_graph_ms'], r['pct_of_bound_graph'],
          'dense', r['dense_mla_ms'], r['dense_pct_of_bound'])
" $R/kernels_dsa.json
timeout 150 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/decode20 --heads 20 > $R/kernels_mla_20.log 2>&1
echo "kernels_mla 20 rc=$?"
timeout 170 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/decode_wide --heads 64 128 > $R/kernels_mla_wide.log 2>&1
echo "kernels_mla 64/128 rc=$?"
python3 -c "import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f))['cases']:
        print(r['heads'], r['case'], r['form'], r['splits'], r['ms'], r['pct_of_bound'])
" $R/decode20/kernels_mla.json $R/decode_wide/kernels_mla.json
tar czf $OUT/splits.tgz -C /tmp splits
