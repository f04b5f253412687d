#!/usr/bin/env bash
# Issues 16 and 17: the Gluon MLA decode (mla/decode_gluon.py) as "auto"'s pick on sm90, in one
# call (~6 minutes): the GPU tests its defaults touch (the Gluon kernels, the Triton launcher,
# DSA's sparse attention in both kernels), kernels_mla over few-row steps (flat / split / gluon)
# and at 128 heads (split / gluon), kernels_dsa --decode-only (DSA's decode step in a CUDA graph
# with sparse_gluon; the Triton sparse MLA at its default tile beside it) and mla_once's sparse
# A/B. Results as $OUT/gluon_default.tgz.
#   bash benchmarks/h200/gluon_default_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/gluon_default; mkdir -p $R
timeout 240 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/attention/test_mla_decode_gluon.py tests/kernels/attention/test_dsa_triton_gpu.py \
  tests/kernels/attention/test_mla_triton.py tests/kernels/attention/test_mla_decode_flat.py \
  > $R/gpu_tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" $R/gpu_tests.log | tail -8
timeout 100 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/few --heads 20 64 128 \
  --few-rows --forms flat split gluon > $R/kernels_mla_few.log 2>&1
echo "kernels_mla few rc=$?"
timeout 100 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/h128 --heads 128 \
  --forms split gluon > $R/kernels_mla_h128.log 2>&1
echo "kernels_mla 128 rc=$?"
timeout -s INT 150 python3 -m benchmarks.kernels.mla.kernels_dsa --out $R --decode-only \
  --tiles 64,64,8,2 > $R/kernels_dsa.log 2>&1
echo "kernels_dsa rc=$?"
python3 -c "
import json
for r in json.load(open('/tmp/gluon_default/kernels_dsa.json'))['decode']:
    print(r['case'], 'score', r['score_ms'], 'sparse', r['sparse_mla_ms'], 'step graph',
          r['dsa_graph_ms'], r['pct_of_bound_graph'], 'triton tile', r.get('sparse_mla_tiles'))
"
for args in "--batch 256 --context 8192" "--batch 32 --context 65536" \
            "--batch 128 --context 32768" "--batch 256 --context 65536"; do
  for g in "" --gluon; do
    timeout 60 python3 -m benchmarks.kernels.mla.mla_once --kind sparse $args $g 2>>$R/once.err \
      | tail -1 | tee -a $R/mla_once.jsonl | cut -c1-60,200-330
  done
done
python3 -m benchmarks.kernels.mla.mla_cases_table $R/few/kernels_mla.json $R/h128/kernels_mla.json
tar czf $OUT/gluon_default.tgz -C /tmp gluon_default
