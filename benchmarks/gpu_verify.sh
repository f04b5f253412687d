#!/usr/bin/env bash
# One GPU call that proves a branch before it lands: every GPU test, the routed MoE layer against
# its read bound (every backend and variant of kernels_moe), the MoE launches apart, W1 through
# the server at 256-2,048, and one decode and one mixed step's kernel profile at 1,024 rows.
# ~6 minutes on the H200. Each stage re-packs OUT into $OUT/verify.tgz when $OUT is set (at most
# 8 files come back from the device machine, and a command cut off at its limit keeps what was
# packed).
#
#   MOESERVE_GIT_COMMIT=<sha> bash benchmarks/gpu_verify.sh /tmp/verify
set -uo pipefail
out=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$out"
py=${PYTHON:-python3}
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/verify.tgz" -C "$(dirname "$out")" "$(basename "$out")"; }
echo "== GPU tests $(date +%T)"
# Only the files that hold GPU tests are collected: the others import what the GPU machine may
# lack (openai for the server tests) and their tests would be deselected anyway.
mapfile -t gpu_files < <(grep -rlE "pytest\.mark\.gpu|pytestmark = .*gpu" tests --include="test_*.py")
timeout 200 "$py" -m pytest -q -m gpu "${gpu_files[@]}" > "$out/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$out/gpu_tests.log"; pack
echo "== MoE layer $(date +%T)"
timeout 200 "$py" -m benchmarks.kernels_moe --out "$out/kmoe" --tokens 64 256 1024 2048 8192 \
  > "$out/kernels_moe.log" 2>&1
echo "rc=$?"; grep '"dummy"' "$out/kernels_moe.log" | cut -c1-120; pack
echo "== MoE launches $(date +%T)"
timeout 90 "$py" -m benchmarks.moe_launches --tokens 2048 1024 --deadline-s 70 --out "$out" \
  > "$out/moe_launches.log" 2>&1
echo "rc=$?"; grep "^tokens" "$out/moe_launches.log"; pack
echo "== W1 $(date +%T)"
VARIANTS="${VARIANTS:-baseline}" timeout 200 bash benchmarks/w1_levers.sh "$out/w1" \
  ${CONCURRENCY:-256 512 1024 2048}
grep -h "^engine:" "$out"/w1/*.log; pack
echo "== step profile $(date +%T)"
timeout 80 "$py" benchmarks/profile_step.py --batch 1024 --steps 5 --out "$out/prof" \
  > "$out/profile_step.log" 2>&1
echo "rc=$?"; tail -1 "$out/profile_step.log" | cut -c1-300; pack
