#!/usr/bin/env bash
# Issues 16 and 17: decode_gluon's split decodes at one program an SM (DECODE_WAVES 1; the
# Triton kernels' rule takes two), and W1's token budget at 1,024 streams, in one call (~6
# minutes): the GPU tests of the Gluon and DSA kernels, kernels_mla over few-row steps (split /
# gluon) at 20 / 64 / 128 heads, kernels_dsa --decode-only (DSA's decode step in a CUDA graph),
# then W1 on glm-4.7-flash with --max-num-batched-tokens: RUNS "concurrency:budget ..." (default
# 1024:4096 1024:16384; the default budget, 8,192, ran in the removed
# gluon_persistent_h200.sh w1 at 4055ab5: benchmarks/results/gpu_c432eb0/call3). Results
# as $OUT/gluon_waves.tgz.
#   bash benchmarks/h200/gluon_waves_h200.sh          # all of it
#   W1_ONLY=1 RUNS="512:16384 1024:32768" bash benchmarks/h200/gluon_waves_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/gluon_waves; mkdir -p $R
if [ -z "${W1_ONLY:-}" ]; then
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/attention/test_mla_decode_gluon.py tests/kernels/attention/test_dsa_triton_gpu.py \
  > $R/gpu_tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" $R/gpu_tests.log | tail -8
timeout 100 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/few --heads 20 64 128 \
  --few-rows --forms split gluon > $R/kernels_mla_few.log 2>&1
echo "kernels_mla few rc=$?"
timeout -s INT 150 python3 -m benchmarks.kernels.mla.kernels_dsa --out $R --decode-only \
  > $R/kernels_dsa.log 2>&1
echo "kernels_dsa rc=$?"
python3 -c "
import json
for r in json.load(open('/tmp/gluon_waves/kernels_dsa.json'))['decode']:
    print(r['case'], 'score', r['score_ms'], 'sparse', r['sparse_mla_ms'], 'step graph',
          r['dsa_graph_ms'], r['pct_of_bound_graph'])
"
python3 -m benchmarks.kernels.mla.mla_cases_table $R/few/kernels_mla.json
fi
for run in ${RUNS:-1024:4096 1024:16384}; do
  c=${run%%:*}; budget=${run#*:}
  w1_run glm-4.7-flash "$c" "w1_c${c}_budget$budget" $R -- --max-num-batched-tokens "$budget"
done
gzip -f $R/*.jsonl
tar czf $OUT/gluon_waves.tgz -C /tmp gluon_waves
