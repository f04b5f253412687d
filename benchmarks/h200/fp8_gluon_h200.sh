#!/usr/bin/env bash
# Issue 18: the FP8 MoE's Gluon grouped GEMM (kernels/moe/quant/fp8_gluon.py: each K step's
# products promoted a step late, so the wgmmas run through the block-scale multiply, where
# Triton's kernel waits for each; at 8,192 tokens that kernel is at 32-33% of the FP8 peak,
# the issue's bar 60%). One call (~5 minutes):
#   1. its GPU tests and the FP8 MoE's (tests/kernels/moe/test_moe_fp8_gluon.py, the fp8 cases
#      of test_moe_quant_triton.py) -> $OUT/fp8_gluon_tests.log
#   2. kernels_quant's FP8 rows at 1,024 and 8,192 tokens, qwen3-30b-a3b's and GLM-5's experts,
#      fused_triton's kernel against the Gluon one at the tuned row blocks and at 128, its gated
#      launch as two wgmmas a step and as one (--profile: each launch's GPU time)
#      -> $OUT/fp8/kernels_quant.json
#   bash benchmarks/h200/fp8_gluon_h200.sh
# (TESTS_LAST=1: the timings first, the tests after, within TESTS_TIMEOUT seconds; SHAPES,
# TOKENS, KQ_TIMEOUT, FP8_MOE narrow the timings; GATED_N="64 32", DOWN_N="128 64" add the
# N tiles' settings)
set -uo pipefail
source benchmarks/gpu_env.sh
gpu_tests() {
  timeout -s INT ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/moe/test_moe_fp8_gluon.py "tests/kernels/moe/test_moe_quant_triton.py" tests/kernels/moe/test_moe_quant_triton_gpu.py \
    -k "fp8 or gluon" > $OUT/fp8_gluon_tests.log 2>&1
  echo "GPU tests: $(tail -1 $OUT/fp8_gluon_tests.log)"
  grep -E "^(FAILED|ERROR)|Error" $OUT/fp8_gluon_tests.log | head -20
}
[ "${TESTS_LAST:-0}" = 1 ] || gpu_tests
timeout -s INT ${KQ_TIMEOUT:-330} python3 -m benchmarks.quant.kernels_quant --out $OUT/fp8 \
  --formats fp8 --no-linear --tokens ${TOKENS:-1024 8192} --shapes ${SHAPES:-qwen3-30b-a3b glm-5} \
  --fp8-moe ${FP8_MOE:-triton gluon gluon-128} --fp8-gluon-dot two one \
  --fp8-gluon-gated-n ${GATED_N:-64} --fp8-gluon-down-n ${DOWN_N:-128} --profile > $OUT/fp8_kq.log 2>&1
echo "kernels_quant rc=$?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "fp8", "kernels_quant.json")))
print("fp8 peak", d.get("peaks", {}).get("fp8_peak_tflops"))
keep = ("shape", "tokens", "fp8_moe", "fp8_gluon_dot", "fp8_gluon_gated_n", "fp8_gluon_down_n",
        "ms", "tflops", "pct_of_fp8_peak", "pct_of_read_bound",
        "finite", "max_rel_err", "error")
for r in d["moe"]:
    print({k: r[k] for k in r if k in keep or "err" in k}, r.get("kernels", [])[:4])
PY
if [ "${TESTS_LAST:-0}" = 1 ]; then gpu_tests; fi
