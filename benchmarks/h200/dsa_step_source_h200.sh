#!/usr/bin/env bash
# Issue 17: at which SASS instructions the warps of DSA's decode step at 32 rows of 8k wait
# (the step 0.108 ms on an H100 against a 0.0475 ms read bound; the sparse MLA reads DRAM at
# ~50% of peak and neither deeper copy pipelines nor early address loads moved it,
# gpu_5c4e2c2 / gpu_6f54c80). Nsight Compute's source counters over every kernel of one step
# (scores, bisect top-k, sparse MLA, split combine), summarized by
# benchmarks/kernels/ncu_source_top.py (stalls by reason, the instructions holding the most
# samples). One call, ~2 minutes -> $OUT/dsa_source.tgz (source CSVs and summaries).
#   bash benchmarks/h200/dsa_step_source_h200.sh        # BATCH=32 CONTEXT=8192
set -uo pipefail
source benchmarks/gpu_env.sh
dir=/tmp/dsa_source; mkdir -p $dir
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
name=dsa_b${BATCH:-32}_ctx${CONTEXT:-8192}
timeout ${NCU_TIMEOUT:-240} "$NCU" --profile-from-start off --target-processes all -c 4 \
  --clock-control none --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --import-source no -o $dir/$name -f \
  python3 -m benchmarks.kernels.mla.dsa_step_once --batch ${BATCH:-32} --context ${CONTEXT:-8192} \
  --calls 1 > $dir/$name.log 2>&1
echo "ncu rc=$?"
if [ -f $dir/$name.ncu-rep ]; then
  "$NCU" --import $dir/$name.ncu-rep --page source --csv > $dir/$name.source.csv 2>&1
  python3 -m benchmarks.kernels.ncu_source_top $dir/$name.source.csv --top ${TOP:-30} \
    | tee $dir/$name.top.txt
fi
tail -3 $dir/$name.log
tar czf $OUT/dsa_source.tgz --exclude="*.ncu-rep" -C /tmp dsa_source
