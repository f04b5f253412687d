#!/usr/bin/env bash
# `pytest -m gpu` over the test tree in parts, one call each (the whole tree takes more than a
# call's 600 s on the H200: gpu_e6ddc73/call2), into $OUT/gpu_tests.log:
#   bash benchmarks/h200/gpu_tests_h200.sh 1/2     # then 2/2 in the next call
# On an H100 the first half took more than a call (gpu_b8a5462/call1: 181 tests in 560 s):
# there, thirds (1/3, 2/3, 3/3).
# The parts are the test files split by their GPU tests' count (gpu_env.sh's gpu_test_part);
# GPU_TESTS_TIMEOUT seconds (default 540; pytest is interrupted there and prints its summary).
set -uo pipefail
source benchmarks/gpu_env.sh
part=${1:?usage: gpu_tests_h200.sh K/N}
gpu_test_part "$part" > "$OUT/gpu_tests_files.txt"
echo "part $part: $(wc -l < "$OUT/gpu_tests_files.txt") files"
run_gpu_tests "${GPU_TESTS_TIMEOUT:-540}" "$part"
rc=$?  # pytest's (the worse of the two runs'), not the grep's
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
exit "$rc"
