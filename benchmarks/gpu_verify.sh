#!/usr/bin/env bash
# One GPU call that proves a branch before it lands: every GPU test, the MoE launches apart, and
# W1 through the server (baseline and multi-step) at 256-2,048. ~7-8 minutes on the H200; the
# result files go under OUT (at most 8 files come back from the device machine: one tarball).
#
#   MOESERVE_GIT_COMMIT=<sha> bash benchmarks/gpu_verify.sh /tmp/verify; \
#       tar czf $OUT/verify.tgz -C /tmp verify
set -uo pipefail
out=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$out"
py=${PYTHON:-python3}
echo "== GPU tests $(date +%T)"
# Only the files that hold GPU tests are collected: the others import what the GPU machine may
# lack (openai for the server tests) and their tests would be deselected anyway.
mapfile -t gpu_files < <(grep -rlE "pytest\.mark\.gpu|pytestmark = .*gpu" tests --include="test_*.py")
timeout 300 "$py" -m pytest -q -m gpu "${gpu_files[@]}" > "$out/gpu_tests.log" 2>&1
echo "rc=$?"; tail -3 "$out/gpu_tests.log"
echo "== MoE launches $(date +%T)"
timeout 120 "$py" -m benchmarks.moe_launches --tokens 2048 1024 --deadline-s 100 --out "$out" \
  > "$out/moe_launches.log" 2>&1
echo "rc=$?"; grep "^tokens" "$out/moe_launches.log"
echo "== W1 $(date +%T)"
VARIANTS="${VARIANTS:-baseline multistep4}" bash benchmarks/w1_levers.sh "$out/w1" \
  ${CONCURRENCY:-256 512 1024 2048}
grep -h "^engine:" "$out"/w1/*.log
