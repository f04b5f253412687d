#!/usr/bin/env bash
# Issue 18: what holds the FP8 MoE at 8,192 tokens to 33% of the FP8 peak, Triton's kernel and
# the Gluon one alike (gpu_6433006/call1 on an H100: 1.37 / 1.36 ms for qwen3-30b-a3b's experts,
# the grouped GEMMs 1.11-1.13 ms of it); the Gluon loop issues ~425 instructions a warp for
# two K steps (128 of them the promotion's FFMAs), so with two 4-warp programs an SM the
# schedulers may be what binds. One call (~5 minutes):
#   1. kernels_quant's FP8 rows at 64 and 256 tokens (the read-bound bar, 75%), both shapes,
#      Triton against Gluon (its gated launch two dots and one) -> $OUT/small/kernels_quant.json
#   2. the Gluon kernel's shared-memory depth at 8,192 tokens (STAGES 4, 5, 6), qwen3's experts
#      -> $OUT/stages/kernels_quant.json
#   3. Nsight Compute over both launches of one call at 8,192 tokens, qwen3's experts: Triton,
#      Gluon (64 rows, one dot), Gluon 128 rows: speed of light, issue slots, pipes, L2, stalls,
#      occupancy -> text pages in $OUT/ncu_fp8.tgz
#   bash benchmarks/h200/fp8_gluon_ncu_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
kq() {  # OUTDIR LIMIT ARGS...: kernels_quant's FP8 MoE rows
  local out=$1 limit=$2; shift 2
  timeout -s INT "$limit" python3 -m benchmarks.quant.kernels_quant --out "$OUT/$out" \
    --formats fp8 --no-linear --profile "$@" > "$OUT/$out.log" 2>&1
  echo "$out: kernels_quant rc=$?"
  python3 - "$OUT/$out/kernels_quant.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("fp8 peak", d.get("peaks", {}).get("fp8_peak_tflops"))
for r in d["moe"]:
    tags = [str(r.get(t)) for t in ("fp8_moe", "fp8_gluon_dot", "fp8_gluon_stages")]
    print(r["shape"], r["tokens"], *tags, r.get("ms"), "read%", r.get("pct_of_read_bound"),
          "peak%", r.get("pct_of_fp8_peak"), r.get("error", ""))
PY
}
kq small ${SMALL_TIMEOUT:-150} --tokens 64 256 --shapes qwen3-30b-a3b glm-5 \
  --fp8-moe triton gluon --fp8-gluon-dot two one
kq stages ${STAGES_TIMEOUT:-100} --tokens 8192 --shapes qwen3-30b-a3b --fp8-moe gluon \
  --fp8-gluon-dot one --fp8-gluon-stages 4 5 6
dir=/tmp/ncu_fp8; mkdir -p $dir
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats"
for case in "triton fp8_moe=triton" "gluon fp8_moe=gluon fp8_gluon_dot=one" \
    "gluon128 fp8_moe=gluon-128 fp8_gluon_dot=one"; do
  read -r name settings <<< "$case"
  switches=(); for s in $settings; do switches+=(--switch "$s"); done
  # shellcheck disable=SC2086
  NCU_ALL=1 ncu_profile $dir ncu_$name 120 \
    "Duration|Throughput|Issue Slots|Issued Ipc|Occupancy|Registers|Pipe|L2 Cache|Shared Memory" \
    --clock-control none -k regex:"_fused_moe_quant|_moe_fp8" -c 2 $sections \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -- \
    python3 -m benchmarks.quant.moe_quant_once --format fp8 --shape qwen3-30b-a3b \
    --tokens 8192 --calls 1 "${switches[@]}"
  rm -f $dir/*.ncu-rep
done
for f in $dir/ncu_*_all.txt; do
  echo "== $f"; grep -E "stalled_.*ratio" "$f" | sort -k3 -n -r | head -8
done
tar czf $OUT/ncu_fp8.tgz -C /tmp ncu_fp8
