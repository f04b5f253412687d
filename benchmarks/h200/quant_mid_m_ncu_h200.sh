#!/usr/bin/env bash
# Issue 18: what holds the NVFP4 fused MoE at W1's 1,024 tokens (~64 pairs an expert) to 28% of
# its read bound (qwen3-30b-a3b's experts 0.42 ms on an H100, gpu_2775d26; the W1 decode step's
# MoE 19.5 of 32.3 ms). Its sm90 loop retires each wgmma at once (`WARPGROUP.DEPBAR.LE gsb0,
# 0x0` after the HGMMAs: Triton keeps a dot asynchronous only when both operands come from its
# pipelined loads, and the decoded weights come from registers), so a program's decode, its
# MMA and its waits run in turn, overlapped only by the SM's other program. One call (~3 min):
# 1. the op's times, micro-tiled NVFP4 against bf16, qwen3-30b-a3b's and GLM-5's experts at
#    1,024 tokens (moe_quant_once) -> $OUT/times.txt
# 2. Nsight Compute at the machine's clocks over both launches of one NVFP4 call (gated, down)
#    at qwen3's shape and the gated one at GLM-5's: speed of light, pipe use, issue slots,
#    warp stall reasons, occupancy -> text pages in $OUT/ncu_mid_m.tgz
#   bash benchmarks/h200/quant_mid_m_ncu_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/ncu_mid_m; mkdir -p $dir
for shape in qwen3-30b-a3b glm-5; do
  for fmt in nvfp4 bf16; do
    timeout 90 python3 -m benchmarks.quant.moe_quant_once --format $fmt --shape $shape \
      --tokens 1024 --weight-layout micro 2>>$dir/once.err \
      | tail -1 | sed "s/^/$shape $fmt: /" | tee -a $OUT/times.txt
  done
done
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for case in "qwen3-30b-a3b 2" "glm-5 1"; do
  read -r shape count <<< "$case"
  # shellcheck disable=SC2086
  NCU_ALL=1 ncu_profile $dir ncu_$shape 120 \
    "Duration|Throughput|Issue Slots|Occupancy|Registers|Warp Cycles|Pipe" \
    --clock-control none -k regex:_fused_moe_quant -c $count $sections \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -- \
    python3 -m benchmarks.quant.moe_quant_once --format nvfp4 --shape $shape --tokens 1024 \
    --weight-layout micro --calls 1
  rm -f $dir/*.ncu-rep
done
grep -h -E "stalled_.*ratio" $dir/ncu_*_all.txt 2>/dev/null | sort -k3 -n -r | head -30
tar czf $OUT/ncu_mid_m.tgz -C /tmp ncu_mid_m
