#!/usr/bin/env bash
# Issue 18: do the 4-bit fused MoE's weight loads want 256-K steps? At BLOCK_K 128 a program
# reads 64 bytes of each packed weight row a step, half a 128-byte line (FP8's 128-K step and
# bf16's 64 read whole lines); NVFP4 and INT4 reach the same ~60% of the H100's DRAM peak by
# Nsight Compute (gpu_2d81e17/call5-6) at different instruction counts, while FP8's experts
# read ~3.1 TB/s by kernels_quant's count (gpu_6b1031a). The quantized tuner's grid had BLOCK_K
# 64 and 128 only (128 and 256 since). One call (~1 min on an H100): moe_quant_once --tile at
# GLM-5's expert shape (then qwen3-30b-a3b's), the tuned / default tiles first, each a JSON
# line, into $OUT/block_k.jsonl. With LAYOUTS=1 (~4 more minutes) then the micro-tiles' GPU
# tests and kernels_quant's NVFP4 / INT4 MoE rows with the packed experts in rows or micro-tiles
# (--weight-layout rows micro: kernels/moe/quant/micro_tiles.py, whole kilobytes a 128-K step)
# and the group scales row- or K-major (--scale-layout rows k-major: at BLOCK_K 128 a step reads
# 8 scale bytes a weight row) into $OUT/layouts/kernels_quant.json, and GLM-5's micro-tiled
# experts at 64 tokens by tile (128- and 256-K steps) into $OUT/layouts/micro_tiles.jsonl.
#   bash benchmarks/h200/quant_block_k_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
tiles=(--tile 16 64 128 4 3 --tile 16 64 128 4 4 --tile 16 32 256 4 3 --tile 16 32 256 4 4
       --tile 16 64 256 8 3 --tile 16 64 256 4 3 --tile 16 32 128 4 4)
for case in "glm-5 nvfp4 64" "glm-5 int4 64" "glm-5 nvfp4 256" "qwen3-30b-a3b nvfp4 64"; do
  read -r shape fmt tokens <<< "$case"
  echo "== $case" | tee -a $OUT/block_k.log
  timeout 120 python3 -m benchmarks.quant.moe_quant_once --format $fmt --shape $shape \
    --tokens $tokens "${tiles[@]}" 2>>$OUT/block_k.log \
    | sed "s/^{/{\"case\": \"$case\", /" | tee -a $OUT/block_k.jsonl
done
if [ "${LAYOUTS:-0}" = 1 ]; then
  mkdir -p $OUT/layouts
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/moe/test_moe_quant_micro.py tests/kernels/moe/test_moe_quant_triton.py tests/kernels/moe/test_moe_quant_triton_gpu.py \
    > $OUT/layouts/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -2 $OUT/layouts/gpu_tests.log
  for fmt in nvfp4 int4; do  # micro-tiles at 128- and 256-K steps, GLM-5's experts
    timeout 120 python3 -m benchmarks.quant.moe_quant_once --format $fmt --shape glm-5 \
      --tokens 64 --weight-layout micro --tile 16 64 128 4 3 --tile 16 64 128 4 4 \
      --tile 16 64 256 4 3 2>>$OUT/layouts/micro_tiles.log \
      | sed "s/^{/{\"case\": \"glm-5 $fmt 64 micro\", /" | tee -a $OUT/layouts/micro_tiles.jsonl
  done
  timeout -s INT 300 python3 -m benchmarks.quant.kernels_quant --out $OUT/layouts \
    --formats nvfp4 int4 --no-linear --tokens 64 256 1024 --weight-layout rows micro \
    --scale-layout rows k-major > $OUT/layouts/kq.log 2>&1
  echo "kernels_quant rc=$?"
  python3 - "$OUT/layouts/kernels_quant.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["moe"]:
    print(r["shape"], r["format"], r["tokens"], r.get("weight_layout"), r.get("scale_layout"),
          r.get("ms"), r.get("pct_of_read_bound"), r.get("error", ""))
PY
fi
