#!/usr/bin/env bash
# At which SASS instructions a command's kernels wait: Nsight Compute's source counters over
# the first COUNT kernels (of those matching KERNEL, a regex; all by default) that the command
# launches between cudaProfilerStart and cudaProfilerStop (the *_once scripts profile that
# way), summarized by benchmarks/kernels/ncu_source_top.py (stalls by reason, the TOP
# instructions holding the most samples). One call, ~1-2 minutes -> $OUT/ncu_source.tgz (the
# source CSV and the summary). With no command: issue 17's DSA decode step at 32 x 8k (scores,
# bisect top-k, sparse MLA, split combine), as session 54 ran it (gpu_de8d30e/call6).
#   bash benchmarks/h200/ncu_source_h200.sh
#   KERNEL=_mla_swapped_kernel COUNT=1 bash benchmarks/h200/ncu_source_h200.sh \
#     python3 -m benchmarks.kernels.mla.mla_once --kind dense --gluon --heads 20 \
#     --batch 1024 --context 192 --calls 1
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/ncu_source; mkdir -p $dir
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
if [ $# -eq 0 ]; then
  set -- python3 -m benchmarks.kernels.mla.dsa_step_once --batch 32 --context 8192 --calls 1
  COUNT=${COUNT:-4}
fi
name=${NAME:-source}
timeout ${NCU_TIMEOUT:-240} "$NCU" --profile-from-start off --target-processes all \
  -c ${COUNT:-4} ${KERNEL:+-k regex:$KERNEL} --clock-control none --section SpeedOfLight \
  --section WarpStateStats --section SourceCounters --import-source no -o $dir/$name -f \
  "$@" > $dir/$name.log 2>&1
echo "ncu rc=$?"
if [ -f $dir/$name.ncu-rep ]; then
  "$NCU" --import $dir/$name.ncu-rep --page source --csv > $dir/$name.source.csv 2>&1
  python3 -m benchmarks.kernels.ncu_source_top $dir/$name.source.csv --top ${TOP:-30} \
    | tee $dir/$name.top.txt
fi
tail -3 $dir/$name.log
tar czf $OUT/ncu_source.tgz --exclude="*.ncu-rep" -C /tmp ncu_source
