#!/usr/bin/env bash
# Issue 18: the 4-bit decodes rewritten offline in session 43, first on a GPU (~5 min):
#   - INT4's nibble planes (linear/int4_tile.py; int4's default BLOCK_K 128 since): sm90 SASS
#     404 loop instructions a 128-K step of the 16 x 64 gated tile ("planes-asm") against 1,068
#     ("reshape", 543 a 64-K step at the earlier default);
#   - NVFP4's PTX with one lop3 a nibble (nvfp4_tile.py): 534 -> 502.
# 1. GPU tests: the three INT4 decodes (the PTX's bits are the Triton planes'), NVFP4's asm
#    against its bits decode, the W4A16 linears, the quantized MoE tests.
# 2. kernels_quant, NVFP4 and INT4 MoE rows at both shapes, --nvfp4-decode bits asm,
#    --int4-decode reshape planes planes-asm (tuned tiles where a file has them, else the
#    defaults: INT4 at BLOCK_K 128), no linears. $OUT/quant_decodes.tgz.
#   bash benchmarks/h200/quant_decodes_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/quant_decodes; mkdir -p $R
timeout 240 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/moe/test_moe_quant_int4_planes.py tests/kernels/moe/test_moe_quant_nvfp4_variants.py \
  tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py tests/kernels/linear/ > $R/gpu_tests.log 2>&1
rc=$?
echo "tests rc=$rc"; tail -3 $R/gpu_tests.log
if [ "$rc" = 0 ]; then
  timeout -s INT 280 python3 -m benchmarks.quant.kernels_quant --out $R --formats nvfp4 int4 \
    --no-linear --nvfp4-decode bits asm --int4-decode reshape planes planes-asm \
    > $R/kernels_quant.log 2>&1
  echo "kernels_quant rc=$?"
  python3 - <<'PY'
import json
for r in json.load(open("/tmp/quant_decodes/kernels_quant.json"))["moe"]:
    print(r["shape"], r["format"], r["tokens"], r.get("decode") or r.get("int4_decode"),
          r["ms"], r["pct_of_read_bound"], r["tiles"]["config"]["BLOCK_K"])
PY
fi
tar czf $OUT/quant_decodes.tgz -C /tmp quant_decodes
