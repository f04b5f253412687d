#!/usr/bin/env bash
# Issue 17: what the DSA decode top-k's time at few rows is (32 x 8k: ~0.036 ms in a CUDA graph
# on the H100 in every form, for 1 MB of scores; the DSA step's bar at 32 x 8k needs the whole
# step in ~0.056 ms on the H200). One call (~3 min): topk_once's eager timings of the row,
# chunks and coop forms (each also with GATHER) at 32 x 8k and the row form at 256 x 8k, then
# Nsight Compute over one call of each form at 32 x 8k (every kernel of the call: the chunks
# form's memset and six launches), with the warp stall reasons and the source counters (which
# SASS lines stall). Reports as text in $OUT/ncu_topk.tgz, timings in $OUT/topk_once.jsonl.
#   bash benchmarks/h200/topk_ncu_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/ncu_topk; mkdir -p $dir
for form in row chunks coop; do
  for g in "" --gather; do
    timeout 60 python3 -m benchmarks.kernels.mla.topk_once --form $form $g 2>>$dir/once.err \
      | tail -1 | tee -a $OUT/topk_once.jsonl
  done
done
timeout 60 python3 -m benchmarks.kernels.mla.topk_once --form row --batch 256 \
  2>>$dir/once.err | tail -1 | tee -a $OUT/topk_once.jsonl
for shape in "4096 16" "8192 32"; do  # the row form's warps: latency hidden by more of them
  set -- $shape
  timeout 60 python3 -m benchmarks.kernels.mla.topk_once --form row --block $1 --warps $2 \
    2>>$dir/once.err | tail -1 | tee -a $OUT/topk_once.jsonl
done
sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section SourceCounters"
for form in row chunks coop; do
  # shellcheck disable=SC2086
  ncu_profile $dir topk_$form 150 \
    "^  [a-z_]+.*\(|Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall|Registers" \
    -c 8 $sections -- python3 -m benchmarks.kernels.mla.topk_once --form $form --calls 1
done
cp $dir/once.err $OUT/ 2>/dev/null
tar czf $OUT/ncu_topk.tgz --exclude="*.ncu-rep" -C /tmp ncu_topk
