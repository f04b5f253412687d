#!/usr/bin/env bash
# Issue 18, one call (~9 minutes; bf16 qwen3-30b-a3b at 1,024 streams needs the H200's memory):
#   1. the FP8 MoE's GPU tests (the Gluon kernel the default; its scales through shared memory
#      against loaded, bit for bit; act quantized in the epilogue) -> $OUT/fp8_tests.log
#   2. kernels_quant's FP8 rows at 1,024 and 8,192 tokens, qwen3-30b-a3b's experts, the Gluon
#      kernel's step scales loaded in the step against copied with its operands
#      (fp8_gluon.smem_scales) -> $OUT/scales/kernels_quant.json
#   3. the warp-specialized kernel (fp8_gluon_ws.py)'s GPU test (killed at WS_TESTS_TIMEOUT:
#      a hang of its barriers), then its timing against the Gluon default at 1,024 and 8,192
#      tokens -> $OUT/ws_tests.log, $OUT/ws/kernels_quant.json (both timings in $OUT/kq.tgz)
#   4. W1 through the server, bf16 then fp8 (the defaults: Gluon grouped GEMM), 256 / 512 /
#      1,024 streams (quant_w1_h200.sh) -> $OUT/quant_w1.tgz
#   bash benchmarks/h200/fp8_scales_w1_h200.sh
# (TESTS_TIMEOUT, KQ_TIMEOUT, WS_TESTS_TIMEOUT, WS_KQ_TIMEOUT, WS_SHAPES, W1_BUDGET_S,
# W1_FORMATS, W1_CONCS: on an H100 W1_FORMATS=fp8)
set -uo pipefail
source benchmarks/gpu_env.sh
summary() {  # DIR TAG: kernels_quant's rows under $OUT/DIR, each with its switch TAG's value
  python3 - "$OUT/$1/kernels_quant.json" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("fp8 peak", d.get("peaks", {}).get("fp8_peak_tflops"))
for r in d["moe"]:
    print(r["shape"], r["tokens"], r.get(sys.argv[2]), r.get("ms"), "read%",
          r.get("pct_of_read_bound"), "peak%", r.get("pct_of_fp8_peak"), r.get("error", ""),
          [(k["kernel"][:20], k["us"]) for k in r.get("kernels", [])[:2]])
PY
}
timeout -s INT ${TESTS_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/moe/test_moe_fp8_gluon.py tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py \
  -k "(fp8 or gluon) and not warp_specialized" > $OUT/fp8_tests.log 2>&1
echo "GPU tests: $(tail -1 $OUT/fp8_tests.log)"
grep -E "^(FAILED|ERROR)" $OUT/fp8_tests.log | head -20
timeout -s INT ${KQ_TIMEOUT:-70} python3 -m benchmarks.quant.kernels_quant --out $OUT/scales \
  --formats fp8 --no-linear --tokens 1024 8192 --shapes qwen3-30b-a3b --fp8-moe gluon \
  --fp8-gluon-scales global smem --profile > $OUT/scales.log 2>&1
echo "kernels_quant rc=$?"
summary scales fp8_gluon_scales
timeout -s KILL ${WS_TESTS_TIMEOUT:-60} python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/kernels/moe/test_moe_fp8_gluon.py -k warp_specialized > $OUT/ws_tests.log 2>&1
echo "WS tests rc=$?: $(tail -1 $OUT/ws_tests.log)"
grep -E "^(FAILED|ERROR)|Error" $OUT/ws_tests.log | head -10
timeout -s KILL ${WS_KQ_TIMEOUT:-70} python3 -m benchmarks.quant.kernels_quant --out $OUT/ws \
  --formats fp8 --no-linear --tokens 1024 8192 --shapes ${WS_SHAPES:-qwen3-30b-a3b} \
  --fp8-moe gluon gluon-ws --profile > $OUT/ws.log 2>&1
echo "WS kernels_quant rc=$?"
summary ws fp8_moe
FORMATS=${W1_FORMATS:-bf16 fp8} CONCS=${W1_CONCS:-256 512 1024} BUDGET_S=${W1_BUDGET_S:-360} \
  bash benchmarks/h200/quant_w1_h200.sh /tmp/qw1 > $OUT/w1.log 2>&1
tail -5 $OUT/w1.log
python3 - <<'PY'
import json
try:
    d = json.load(open("/tmp/qw1/compare.json"))
except OSError as e:
    print("no compare.json:", e)
else:
    print(json.dumps(d, indent=1)[:3000])
PY
tar czf $OUT/quant_w1.tgz -C /tmp qw1
# the machine returns 8 files: the timings' JSONs and logs in one archive
tar czf $OUT/kq.tgz -C $OUT scales ws scales.log ws.log && rm -rf $OUT/scales $OUT/ws \
  $OUT/scales.log $OUT/ws.log
