#!/usr/bin/env bash
# Issue 18: the FP8 MoE with act quantized in the gated launch's epilogue
# (kernels/moe/quant/fused_triton.py fuse_act_quant: no bf16 act written and read back, no
# quantize launch between the GEMMs) against the separate launch, with each grouped GEMM
# backend (Triton; Gluon for the down launch only, the gated one fused in Triton; Gluon for
# both, act quantized apart). One call (~8 minutes):
#   1. the FP8 MoE's GPU tests (the epilogue's bits against the separate launch's, the Gluon
#      kernel's) -> $OUT/fp8_tests.log
#   2. kernels_quant's FP8 rows at 64 / 256 / 1,024 / 8,192 tokens, qwen3-30b-a3b's and GLM-5's
#      experts (--profile) -> $OUT/fp8/kernels_quant.json
#   bash benchmarks/h200/fp8_act_quant_h200.sh
# (SHAPES, TOKENS, KQ_TIMEOUT, TESTS_TIMEOUT)
set -uo pipefail
source benchmarks/gpu_env.sh
timeout -s INT ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/moe/test_moe_fp8_gluon.py tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py \
  -k "fp8 or gluon" > $OUT/fp8_tests.log 2>&1
echo "GPU tests: $(tail -1 $OUT/fp8_tests.log)"
grep -E "^(FAILED|ERROR)" $OUT/fp8_tests.log | head -20
timeout -s INT ${KQ_TIMEOUT:-380} python3 -m benchmarks.quant.kernels_quant --out $OUT/fp8 \
  --formats fp8 --no-linear --tokens ${TOKENS:-64 256 1024 8192} \
  --shapes ${SHAPES:-qwen3-30b-a3b glm-5} --fp8-act-quant fused apart \
  --fp8-moe triton gluon-down gluon --fp8-gluon-dot one --profile > $OUT/fp8_kq.log 2>&1
echo "kernels_quant rc=$?"
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "fp8", "kernels_quant.json")))
print("fp8 peak", d.get("peaks", {}).get("fp8_peak_tflops"))
for r in d["moe"]:
    print(r["shape"], r["tokens"], r.get("fp8_act_quant"), r.get("fp8_moe"), r.get("ms"),
          "read%", r.get("pct_of_read_bound"), "peak%", r.get("pct_of_fp8_peak"),
          r.get("error", ""))
PY
