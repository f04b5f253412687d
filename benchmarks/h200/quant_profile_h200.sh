#!/usr/bin/env bash
# Issue 18's kernel profile on the H200 (one call, ~3-4 minutes): Nsight Compute over the
# quantized fused MoE's two launches (gated, down) at the cases that miss the issue's targets,
# qwen3-30b-a3b's expert shape: NVFP4 at 64 and 1,024 tokens (both decodes of
# kernels/linear/nvfp4_tile.py at 64), FP8 at 256 and 8,192. Each case's report as text
# (speed of light, compute and memory workload, warp stalls, occupancy, the source's hot
# lines) in OUT/ncu.tgz, and the op's eager time in OUT/ncu/times.txt.
#
#   source benchmarks/gpu_env.sh; bash benchmarks/h200/quant_profile_h200.sh $OUT
set -uo pipefail
out=${1:?usage: quant_profile_h200.sh OUT}
dir=/tmp/ncu
mkdir -p "$dir"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
cases=("nvfp4 64 bits" "nvfp4 64 asm" "nvfp4 1024 bits" "fp8 256 -" "fp8 8192 -")
for case in "${cases[@]}"; do
  read -r fmt tokens decode <<< "$case"
  name="${fmt}_t${tokens}${decode/-/}"
  flags=(--format "$fmt" --tokens "$tokens")
  [ "$decode" != "-" ] && flags+=(--nvfp4-decode "$decode")
  timeout 120 "${PYTHON:-python3}" -m benchmarks.quant.moe_quant_once "${flags[@]}" --calls 5 \
    >> "$dir/times.txt" 2>&1
  timeout 150 "$NCU" --profile-from-start off --target-processes all \
    -k regex:_fused_moe_quant -c 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SourceCounters -o "$dir/$name" -f \
    "${PYTHON:-python3}" -m benchmarks.quant.moe_quant_once "${flags[@]}" --calls 1 \
    > "$dir/$name.log" 2>&1
  echo "$name: ncu rc=$? $(tail -1 "$dir/$name.log")"
  [ -f "$dir/$name.ncu-rep" ] && "$NCU" --import "$dir/$name.ncu-rep" --page details \
    > "$dir/$name.txt" 2>&1
done
cat "$dir/times.txt"
tar czf "$out/ncu.tgz" --exclude="*.ncu-rep" -C /tmp ncu  # the reports as text
