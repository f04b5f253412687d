#!/usr/bin/env bash
# Issue 18's kernel bars in one call (~6-8 min on the H200, most of it weight drawing and Triton
# compiles): kernels_quant's routed-MoE rows (the engine's looked-up tiles, its default FP8 act
# quant fused in the gated epilogue and Gluon FP8 kernel) at the issue's token counts, the
# bf16 rows beside them, and the FP8 dense peak measured in the same run; then its
# `acceptance` printed, one line a bar:
#   FP8 >= 75% of the read bound at 64 / 256 tokens; >= 60% of the FP8 peak at 8,192
#   NVFP4 >= 70% at 64 / 256, >= 60% at 1,024
# over qwen3-30b-a3b's and GLM-5's experts. -> $OUT/kq/kernels_quant.json, $OUT/kq.log.
# The latest figures stand in benchmarks/results/open_bars.md (the H200 ones of session 50
# predate the fused act quant; the NVFP4 ones are the H100's).
#   bash benchmarks/h200/quant_bars_h200.sh     # SHAPES, FORMATS, TOKENS, KQ_TIMEOUT
set -uo pipefail
source benchmarks/gpu_env.sh
# shellcheck disable=SC2086
timeout -s INT ${KQ_TIMEOUT:-540} python3 -m benchmarks.quant.kernels_quant --out "$OUT/kq" \
  --no-linear --formats ${FORMATS:-bf16 fp8 nvfp4} --tokens ${TOKENS:-64 256 1024 8192} \
  --shapes ${SHAPES:-qwen3-30b-a3b glm-5} > "$OUT/kq.log" 2>&1
echo "kernels_quant rc=$? (130: cut by the timeout; the JSON keeps the rows measured)"
python3 - "$OUT/kq/kernels_quant.json" <<'PY'
import json, os, sys
path = sys.argv[1]
if not os.path.exists(path):
    sys.exit("no kernels_quant.json: see kq.log")
d = json.load(open(path))
print("fp8 peak (TFLOP/s):", d.get("peaks", {}).get("fp8_peak_tflops"))
for r in d["moe"]:
    print(f"{r['shape']:<14} {r['format']:<6} {r['tokens']:>5} {r.get('ms')} ms "
          f"read {r.get('pct_of_read_bound')}% peak(fp8) {r.get('pct_of_fp8_peak')}% "
          f"{r.get('error', '')}")
for a in d.get("acceptance", []):
    print(f"BAR {a['shape']:<14} {a['format']:<6} {a['tokens']:>5} {a['what']}: {a['value']} "
          f"(target {a['target']}) {'pass' if a['pass'] else 'MISS'}")
PY
