#!/usr/bin/env bash
# Issue 16: why the MLA decode runs at 35-38% of its read bound at W1's contexts (20 heads,
# 1,024 rows of 129-256 keys; kernels_mla) but 56-62% at 1k-4k keys. One call (~3 minutes):
# mla_once's timings at GLM-4.7-Flash's 20 heads, 1,024 rows, contexts 192 (W1's mean) and
# 4,096, then Nsight Compute over the dense decode kernel at both (a program's fixed costs
# against its per-tile ones). Results: $OUT/mla_w1.jsonl, the reports as text in
# $OUT/ncu_mla_w1.tgz.
#   bash benchmarks/h200/mla_w1_profile_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/ncu_mla_w1; mkdir -p $dir
once() { timeout 90 python3 -m benchmarks.kernels.mla.mla_once --kind dense --heads 20 "$@" \
  2>>$dir/once.err | tail -1 | tee -a $OUT/mla_w1.jsonl; }
for ctx in 192 4096; do once --batch 1024 --context $ctx --splits 1; done
once --batch 1024 --context 192 --splits 1 --tile 16,64,4,3
once --batch 2048 --context 192 --splits 1
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section SchedulerStats"
for ctx in 192 4096; do
  timeout 150 "$NCU" --profile-from-start off --target-processes all -k regex:_decode_kernel \
    -c 1 $sections -o $dir/dense20_ctx$ctx -f python3 -m benchmarks.kernels.mla.mla_once \
    --kind dense --heads 20 --batch 1024 --context $ctx --splits 1 --calls 1 \
    > $dir/dense20_ctx$ctx.log 2>&1
  echo "ctx $ctx: ncu rc=$?"
  [ -f $dir/dense20_ctx$ctx.ncu-rep ] && "$NCU" --import $dir/dense20_ctx$ctx.ncu-rep \
    --page details > $dir/dense20_ctx$ctx.txt 2>&1
  [ -f $dir/dense20_ctx$ctx.ncu-rep ] && "$NCU" --import $dir/dense20_ctx$ctx.ncu-rep \
    --page source --csv > $dir/dense20_ctx$ctx.source.csv 2>&1
done
tar czf $OUT/ncu_mla_w1.tgz --exclude="*.ncu-rep" -C /tmp ncu_mla_w1
