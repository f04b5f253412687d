#!/usr/bin/env bash
# Issue 18: what bounds the W4A16 fused MoE at decode's token counts (NVFP4 49.6 / 46.7%, INT4
# 48.9 / 46.3% of the read bound at GLM-5's shape, 64 / 256 tokens, on an H100 in
# gpu_cc68d51/call1, INT4's 404-instruction loop no faster than NVFP4's 502). Nsight Compute in
# gpu_b1fed26/call2 (SM clocks locked by ncu) saw 25% occupancy (4 programs an SM by registers
# and shared memory), issue slots 58%, DRAM 35%: latency, not one pipe. One call (~5 min;
# everything written under $OUT/quant_occupancy as it goes, so a call cut short keeps it):
# 1. Nsight Compute at the machine's own clocks (--clock-control none) over the gated launch at
#    GLM-5's shape, 64 tokens: NVFP4 with and without the cap of 80, INT4: speed of light,
#    pipe utilizations, warp stall reasons (every section's body, NAME_all.txt), occupancy.
# 2. kernels_quant, NVFP4 and INT4 MoE rows at both shapes, 64 / 256 / 1,024 tokens, with the
#    register cap a thread off / 96 / 80 (5 / 6 programs an SM; sm90 SASS: 20 / 72 bytes
#    spilled): kernels_quant.json.
#   bash benchmarks/h200/quant_occupancy_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT/quant_occupancy; mkdir -p $R
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for case in "nvfp4 off" "nvfp4 80" "int4 off"; do
  read -r fmt cap <<< "$case"
  # shellcheck disable=SC2086
  NCU_ALL=1 ncu_profile $R ncu_${fmt}_${cap} 90 \
    "Duration|Throughput|Issue Slots|Occupancy|Registers|Warp Cycles" \
    --clock-control none -k regex:_fused_moe_quant -c 1 $sections \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -- \
    python3 -m benchmarks.quant.moe_quant_once --format $fmt --shape glm-5 --tokens 64 \
    --calls 1 --maxnreg $cap
  rm -f $R/*.ncu-rep  # large; the text pages stay
done
timeout -s INT ${KQ_LIMIT:-200} python3 -m benchmarks.quant.kernels_quant --out $R \
  --formats nvfp4 int4 --no-linear --tokens 64 256 1024 --maxnreg off 96 80 > $R/kq.log 2>&1
echo "kernels_quant rc=$?"
python3 - "$R/kernels_quant.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["moe"]:
    print(r["shape"], r["format"], r["tokens"], "maxnreg", r.get("maxnreg"), r["ms"],
          r["pct_of_read_bound"])
PY
