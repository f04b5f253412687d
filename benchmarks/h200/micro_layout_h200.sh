#!/usr/bin/env bash
# Issue 18: the engine now holds NVFP4 / INT4 routed experts micro-tiled on CUDA
# (EngineConfig.moe_weight_layout "auto"; kernels/moe/quant/micro_tiles.py) with 128-K default
# decode tiles for them. One call (~4 minutes on an H100):
#   1. the GPU tests of the quantized MoE and of quantized models (micro-tiled experts serve the
#      row layout's tokens; the dequantize-first path reads them back) -> $OUT/gpu_tests.log
#   2. kernels_quant's NVFP4 / INT4 MoE rows, experts in rows and micro-tiled, each at the
#      tiles the engine would run (the micro rows' defaults now 128-K), with SCALES=1 the group
#      scales row- and K-major too (K-major helped INT4 5-8% in gpu_4da0855/call1, untimed
#      with micro-tiles at 128-K steps) -> $OUT/kq/
# Then, on the same warm machine, the served A/B on the seeds' model:
#   LAYERS=12 FORMATS="nvfp4 nvfp4rows" bash benchmarks/h200/glm_nvfp4_w1_h200.sh glm5
#   bash benchmarks/h200/micro_layout_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 \
  tests/kernels/moe/test_moe_quant_micro.py tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py \
  tests/kernels/moe/test_moe_quant_dequant.py tests/kernels/moe/test_moe_quant_tune.py \
  tests/kernels/linear/test_w4a16_dequant.py tests/quant > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
mkdir -p $OUT/kq
timeout -s INT 240 python3 -m benchmarks.quant.kernels_quant --out $OUT/kq \
  --formats nvfp4 int4 --no-linear --tokens 64 256 1024 --weight-layout rows micro \
  $([ "${SCALES:-0}" = 1 ] && echo --scale-layout rows k-major) > $OUT/kq/kq.log 2>&1
echo "kernels_quant rc=$?"
python3 - "$OUT/kq/kernels_quant.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["moe"]:
    c = r.get("tiles", {}).get("config", {})
    print(r["shape"], r["format"], r["tokens"], r.get("weight_layout"), r.get("scale_layout"),
          r.get("ms"),
          r.get("pct_of_read_bound"), c.get("BLOCK_K"), r.get("error", ""))
PY
