#!/usr/bin/env bash
# Issue 16: what bounds decode_gluon_ws at 128 heads (53-56% of the FLOP bound on the H200,
# where FlashMLA reports ~76% of peak). The hypothesis (session 39): shared memory's bandwidth,
# not the tensor cores: the scores' wgmma (M 64 heads, N 64 keys, A and B from shared memory)
# reads 4 KB every 32 clocks, the SM's 128 B a clock, beside the tile copies and P V's operands.
# One call (~3 min): mla_once's timings of the dense Gluon decode at 64 and 128 heads (1,024
# rows x 4,096 keys: decode_gluon_ws's cases), then Nsight Compute over decode_gluon_ws's kernel
# at each (speed of light, compute and memory workload (shared memory's and the tensor pipe's
# shares), warp stall reasons, scheduler). The reports as text in $OUT/ncu_ws.tgz, the timings
# in $OUT/ws_once.jsonl.
#   bash benchmarks/h200/mla_ws_ncu_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/ncu_ws; mkdir -p $dir
for heads in 64 128; do
  timeout 90 python3 -m benchmarks.kernels.mla.mla_once --kind dense --gluon --heads $heads \
    --batch 1024 --context 4096 2>>$dir/once.err | tail -1 | tee -a $OUT/ws_once.jsonl
done
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy"
for heads in 64 128; do
  # shellcheck disable=SC2086
  ncu_profile $dir ws_h$heads 200 \
    "Duration|Compute \(SM\) Throughput|Memory Throughput|Shared|Tensor|Issue Slots|Stall|Warp Cycles" \
    -k regex:_ws_kernel -c 1 $sections -- python3 -m benchmarks.kernels.mla.mla_once \
    --kind dense --gluon --heads $heads --batch 1024 --context 4096 --calls 1
done
cp $dir/once.err $OUT/ 2>/dev/null
tar czf $OUT/ncu_ws.tgz --exclude="*.ncu-rep" -C /tmp ncu_ws
