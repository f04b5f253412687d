#!/usr/bin/env bash
# What holds kernels/moe/gluon_ws.py's warp-specialized bf16 MoE GEMM to ~56% of the bf16 peak
# at 8,192 tokens (gpu_c06bad4 on an H100: glm-4.7-flash's experts 1.396 ms against Triton's
# 1.445), the suspicion being L2's bandwidth (a 128 x 256 tile needs ~9 TB/s from L2 at the
# peak). One call (~6 minutes):
#   1. its GPU tests (both stage-release forms; killed at TESTS_TIMEOUT: a barrier hang)
#      -> $OUT/tests.log
#   2. kernels_moe, Triton's looked-up tiles against both forms, glm-4.7-flash's experts at
#      2,048 and 8,192 tokens -> $OUT/kernels_moe.json
#   3. Nsight Compute over both launches of one call at 8,192 tokens (dummy routing), each
#      backend: speed of light, memory (L2, DRAM), warp stalls, issue slots, occupancy
#      -> text pages in $OUT/ncu_ws.tgz
#   bash benchmarks/h200/gluon_ws_ncu_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout -s KILL ${TESTS_TIMEOUT:-100} python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  tests/kernels/moe/test_moe_gluon_ws.py > $OUT/tests.log 2>&1
echo "gluon_ws tests rc=$?: $(tail -1 $OUT/tests.log)"
grep -E "^(FAILED|ERROR)|Error" $OUT/tests.log | head -10
mkdir -p /tmp/kq
timeout -s KILL ${KQ_TIMEOUT:-90} python3 -m benchmarks.kernels.kernels_moe --out /tmp/kq \
  --preset glm-4.7-flash --tokens 2048 8192 \
  --backends triton gluon_ws gluon_ws_thread_arrive > $OUT/kernels_moe.log 2>&1
echo "kernels_moe rc=$?"
cp /tmp/kq/kernels_moe_glm-4.7-flash.json $OUT/kernels_moe.json 2>/dev/null
python3 - $OUT/kernels_moe.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"no result: {e}")
print("check", d.get("check"))
for r in d.get("rows", []):
    print(r.get("backend"), r.get("routing"), r.get("tokens"), r.get("ms"),
          "tflops", r.get("tflops"), "peak%", r.get("pct_of_787_tflops"))
PY
dir=/tmp/ncu_ws; mkdir -p $dir
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for backend in ${NCU_BACKENDS:-triton gluon_ws}; do
  # shellcheck disable=SC2086
  NCU_ALL=1 ncu_profile $dir ncu_$backend ${NCU_TIMEOUT:-80} \
    "Duration|Throughput|Issue Slots|Issued Ipc|Registers|Pipe|L2 Cache|L1/TEX Hit|L2 Hit|Shared Memory|Block Size|Grid Size" \
    --clock-control none -k regex:"_fused_moe_kernel|_moe_ws_kernel" -c 2 $sections \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex.sum,dram__bytes_read.sum" -- \
    python3 -m benchmarks.kernels.moe_once --backend $backend --preset glm-4.7-flash \
    --tokens 8192 --calls 1
  rm -f $dir/*.ncu-rep
done
for f in $dir/ncu_*_all.txt; do
  echo "== $f"; grep -E "stalled_.*ratio" "$f" | sort -k3 -n -r | head -6
  grep -E "lts__t_bytes.sum.per_second|dram__bytes_read.sum " "$f" | head -4
done
tar czf $OUT/ncu_ws.tgz -C /tmp ncu_ws
