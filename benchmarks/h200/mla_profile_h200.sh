#!/usr/bin/env bash
# Issues 16/17: why DSA's sparse MLA runs at half the dense decode's rate per key (gpu_bc677c8:
# 0.72 ms for 256 rows x 2,048 selected keys at 64 heads; the dense decode over 256 x 8,192
# keys takes 1.46). One call (~4 minutes): benchmarks/kernels/mla/mla_once.py's A/B (split count,
# gathered against contiguous keys, tile, slot_rows) at 256 rows and 32 rows, then Nsight
# Compute over the sparse kernel (gathered and contiguous) and the dense decode at the same
# keys a row. Results: $OUT/mla_ab.jsonl, the reports as text in $OUT/ncu_mla.tgz.
#   bash benchmarks/h200/mla_profile_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/ncu_mla; mkdir -p $dir
once() { timeout 90 python3 -m benchmarks.kernels.mla.mla_once "$@" 2>>$dir/once.err | tail -1 | tee -a $OUT/mla_ab.jsonl; }
for s in 1 2 4; do
  once --kind sparse --batch 256 --context 8192 --splits $s
  once --kind sparse --batch 256 --context 8192 --splits $s --select first
done
once --kind sparse --batch 256 --context 8192 --splits 1 --tile 64,64,8,2
once --kind sparse --batch 256 --context 8192 --splits 1 --slot-rows
once --kind sparse --batch 256 --context 65536
once --kind sparse --batch 256 --context 65536 --splits 1
for s in 4 8 16; do once --kind sparse --batch 32 --context 65536 --splits $s; done
once --kind sparse --batch 32 --context 65536 --splits 8 --select first
for s in 1 4; do once --kind dense --batch 256 --context 2048 --splits $s; done
once --kind dense --batch 256 --context 8192
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section SchedulerStats"
prof() {  # name kernel-regex mla_once args...
  local name=$1 kern=$2; shift 2
  timeout 150 "$NCU" --profile-from-start off --target-processes all -k regex:$kern -c 1 \
    $sections -o $dir/$name -f python3 -m benchmarks.kernels.mla.mla_once "$@" --calls 1 \
    > $dir/$name.log 2>&1
  echo "$name: ncu rc=$?"
  [ -f $dir/$name.ncu-rep ] && "$NCU" --import $dir/$name.ncu-rep --page details > $dir/$name.txt 2>&1
}
prof sparse_b256_random _sparse_attention --kind sparse --batch 256 --context 8192 --splits 1
prof sparse_b256_first _sparse_attention --kind sparse --batch 256 --context 8192 --splits 1 --select first
prof dense_b256_ctx2k _decode_kernel --kind dense --batch 256 --context 2048 --splits 1
cp $dir/once.err $OUT/ 2>/dev/null
tar czf $OUT/ncu_mla.tgz --exclude="*.ncu-rep" -C /tmp ncu_mla
