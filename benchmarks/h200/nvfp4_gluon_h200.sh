#!/usr/bin/env bash
# Issue 18: the NVFP4 fused MoE's 64- and 128-row tiles in Gluon (moe/quant/nvfp4_gluon.py, an
# experiment off unless MOESERVE_NVFP4_GLUON=1: the nibble decode of a K step beside the
# previous step's async wgmmas, where Triton's tile waits for every wgmma group), on the H200,
# one call (~4 min): its GPU test (the Triton tile's output within a bf16 ulp or so, eager and
# in a CUDA graph), then kernels_quant's NVFP4 MoE rows off / on at GLM-5's and qwen3's expert
# shapes, with the tuned tiles (GLM-5's picks have 64-row blocks at 1,024 tokens, 29% of the read
# bound, gpu_4705423/call4, and 128 from 2,048) and the default ones (64 rows from 48 pairs).
# Results as $OUT/nvfp4_gluon.tgz.
#   bash benchmarks/h200/nvfp4_gluon_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/nvfp4_gluon; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/moe/test_moe_quant_nvfp4_variants.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
for tiles in tuned default; do
  timeout 200 python3 -m benchmarks.quant.kernels_quant --out $R/$tiles --formats nvfp4 \
    --shapes glm-5 qwen3-30b-a3b --tokens 1024 2048 4096 --tiles $tiles --nvfp4-gluon off on \
    --moe-dequant off --no-linear > $R/kernels_quant_$tiles.log 2>&1
  echo "kernels_quant --tiles $tiles rc=$?"
  python3 -c "
import json
for r in json.load(open('$R/$tiles/kernels_quant.json'))['moe']:
    print(r['shape'], r['tokens'], 'gluon' if r.get('nvfp4_gluon') else 'triton',
          r['tiles']['config']['BLOCK_M'], r['ms'], r['pct_of_read_bound'])"
done
tar czf $OUT/nvfp4_gluon.tgz -C /tmp nvfp4_gluon
