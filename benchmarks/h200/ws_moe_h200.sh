#!/usr/bin/env bash
# The MoE's two warp-specialized, persistent Gluon kernels, one call (~9-10 minutes):
#   1. bf16 (kernels/moe/gluon_ws.py): its GPU tests (killed at BF16_TESTS_TIMEOUT: a hang of
#      its barriers) -> $OUT/bf16_tests.log; then kernels_moe, Triton's looked-up tiles against
#      it in both its stage-release forms (BF16_BACKENDS), glm-4.7-flash's and qwen3-30b-a3b's
#      experts (BF16_PRESETS) at BF16_TOKENS (default 1024 2048 8192)
#      -> kernels_moe_<preset>.json in $OUT/kq.tgz
#   2. FP8 (kernels/moe/quant/fp8_gluon_ws.py, persistent since session 51): its GPU test
#      (killed at FP8_TESTS_TIMEOUT) -> $OUT/fp8_tests.log; kernels_quant's gluon against
#      gluon-ws at 1,024 and 8,192 tokens, qwen3-30b-a3b's experts -> $OUT/kq.tgz
#   3. W1 through the server, W1_FORMATS (default "bf16 fp8"; bf16 at 512+ streams needs the
#      H200's memory: on an H100 W1_FORMATS=fp8) at W1_CONCS (256 512 1024) in W1_BUDGET_S
#      (default: what is left until W1_END_S, 540 s into the call; quant_w1_h200.sh)
#      -> $OUT/quant_w1.tgz
#   bash benchmarks/h200/ws_moe_h200.sh
#   SKIP_FP8=1 W1_END_S=0 BF16_PRESETS=glm-4.7-flash bash benchmarks/h200/ws_moe_h200.sh
#       # the bf16 kernel's tests and one timing alone (~3 minutes)
set -uo pipefail
W1_END_S=${W1_END_S:-540}
source benchmarks/gpu_env.sh
mkdir -p /tmp/kq
timeout -s KILL ${BF16_TESTS_TIMEOUT:-100} python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/kernels/moe/test_moe_gluon_ws.py > $OUT/bf16_tests.log 2>&1
echo "bf16 WS tests rc=$?: $(tail -1 $OUT/bf16_tests.log)"
grep -E "^(FAILED|ERROR)|Error" $OUT/bf16_tests.log | head -10
for preset in ${BF16_PRESETS:-glm-4.7-flash qwen3-30b-a3b}; do
  timeout -s KILL ${BF16_KQ_TIMEOUT:-80} python3 -m benchmarks.kernels.kernels_moe --out /tmp/kq \
    --preset $preset --tokens ${BF16_TOKENS:-1024 2048 8192} \
    --backends ${BF16_BACKENDS:-triton gluon_ws gluon_ws_thread_arrive} \
    > /tmp/kq/bf16_$preset.log 2>&1
  echo "kernels_moe $preset rc=$?"
  python3 - /tmp/kq/kernels_moe_$preset.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"no result: {e}")
print("check", d.get("check"))
for r in d.get("rows", []):
    print(r.get("backend"), r.get("routing"), r.get("tokens"), r.get("ms"),
          "tflops", r.get("tflops"), "read%", r.get("pct_of_read_bound"))
PY
done
if [ -z "${SKIP_FP8:-}" ]; then
timeout -s KILL ${FP8_TESTS_TIMEOUT:-60} python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/kernels/moe/test_moe_fp8_gluon.py -k warp_specialized > $OUT/fp8_tests.log 2>&1
echo "FP8 WS tests rc=$?: $(tail -1 $OUT/fp8_tests.log)"
grep -E "^(FAILED|ERROR)|Error" $OUT/fp8_tests.log | head -10
timeout -s KILL ${FP8_KQ_TIMEOUT:-70} python3 -m benchmarks.quant.kernels_quant --out /tmp/kq/fp8 \
  --formats fp8 --no-linear --tokens 1024 8192 --shapes qwen3-30b-a3b \
  --fp8-moe gluon gluon-ws > /tmp/kq/fp8.log 2>&1
echo "FP8 kernels_quant rc=$?"
python3 - /tmp/kq/fp8/kernels_quant.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"no result: {e}")
print("fp8 peak", d.get("peaks", {}).get("fp8_peak_tflops"))
for r in d["moe"]:
    print(r["shape"], r["tokens"], r.get("fp8_moe"), r.get("ms"), "read%",
          r.get("pct_of_read_bound"), "peak%", r.get("pct_of_fp8_peak"), r.get("error", ""))
PY
fi
tar czf $OUT/kq.tgz -C /tmp kq
[ "$W1_END_S" -gt 0 ] || exit 0
FORMATS=${W1_FORMATS:-bf16 fp8} CONCS=${W1_CONCS:-256 512 1024} BUDGET_S=${W1_BUDGET_S:-$((W1_END_S - SECONDS))} \
  bash benchmarks/h200/quant_w1_h200.sh /tmp/qw1 > $OUT/w1.log 2>&1
tail -5 $OUT/w1.log
head -c 3000 /tmp/qw1/compare.json 2>/dev/null || echo "no compare.json"
tar czf $OUT/quant_w1.tgz -C /tmp qw1
