#!/usr/bin/env bash
# One GPU call that proves a branch before it lands: every GPU test, the routed MoE layer against
# its read bound (every backend and variant of kernels_moe), the MoE launches apart, W1 through
# the server at 256-2,048, and one decode and one mixed step's kernel profile at 1,024 rows.
# ~6 minutes on the H200. Each stage re-packs OUT into $OUT/verify.tgz when $OUT is set (at most
# 8 files come back from the device machine, and a command cut off at its limit keeps what was
# packed).
#
#   MOESERVE_GIT_COMMIT=<sha> bash benchmarks/h200/gpu_verify.sh /tmp/verify
#
# STAGES picks stages (default: tests moe launches w1 profile; also: tune attention). "tune"
# first re-runs the quick MoE tune on top of the committed file's ledger (only what it lacks is
# timed) into OUT/tune/configs and points every later stage at it (MOESERVE_MOE_CONFIG_DIR);
# copy that file to moeserve/kernels/moe/configs/ to commit it. "attention" runs
# kernels_attention (decode at 1,024 and 2,048 rows, the prefill tile sweep). TESTS overrides
# the GPU test files; PROFILE_BATCH the step profile's decode rows (1,024).
set -uo pipefail
out=${1:?usage: gpu_verify.sh OUT}
mkdir -p "$out"
py=${PYTHON:-python3}
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/verify.tgz" -C "$(dirname "$out")" "$(basename "$out")"; }
stages=" ${STAGES:-tests moe launches w1 profile} "
want() { [[ "$stages" == *" $1 "* ]]; }
if want tune; then
  echo "== MoE tune $(date +%T)"
  mkdir -p "$out/tune/configs"
  cp moeserve/kernels/moe/configs/*.json "$out/tune/configs/"
  timeout 240 "$py" -m benchmarks.kernels.kernels_moe --out "$out/tune" --tune --tune-only \
    --time-budget 200 > "$out/tune.log" 2>&1
  echo "rc=$?"; grep "best" "$out/tune.log" | cut -c1-200; pack
  export MOESERVE_MOE_CONFIG_DIR="$out/tune/configs"
fi
if want tests; then
  echo "== GPU tests $(date +%T)"
  # The whole test tree, so that fixture-parametrised CUDA cases (marked without their file
  # showing it) are collected too. The server tests import what the GPU machine lacks (fastapi,
  # pyzmq, openai, ...): bring it as wheels first (../shared/device/wheels.sh into .whl, carried)
  # and put them on PYTHONPATH, e.g. with SITE=/tmp/site.
  if [ -n "${SITE:-}" ] && [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl && export PYTHONPATH="$PWD:$SITE"
  fi
  # shellcheck disable=SC2206
  targets=(${TESTS:-tests})
  timeout 300 "$py" -m pytest -q -m gpu -p no:cacheprovider "${targets[@]}" \
    > "$out/gpu_tests.log" 2>&1
  echo "rc=$?"; tail -3 "$out/gpu_tests.log"; pack
fi
if want moe; then
  echo "== MoE layer $(date +%T)"
  timeout 200 "$py" -m benchmarks.kernels.kernels_moe --out "$out/kmoe" --tokens 64 256 1024 2048 8192 \
    > "$out/kernels_moe.log" 2>&1
  echo "rc=$?"; grep '"dummy"' "$out/kernels_moe.log" | cut -c1-120; pack
fi
if want launches; then
  echo "== MoE launches $(date +%T)"
  timeout 90 "$py" -m benchmarks.kernels.moe_launches --tokens 2048 1024 --deadline-s 70 --out "$out" \
    > "$out/moe_launches.log" 2>&1
  echo "rc=$?"; grep "^tokens" "$out/moe_launches.log"; pack
fi
if want w1; then
  echo "== W1 $(date +%T)"
  VARIANTS="${VARIANTS:-baseline}" timeout 200 bash benchmarks/h200/w1_levers.sh "$out/w1" \
    ${CONCURRENCY:-256 512 1024 2048}
  grep -h "^engine:" "$out"/w1/*.log; pack
fi
if want profile; then
  echo "== step profile $(date +%T)"
  timeout 100 "$py" benchmarks/engine/profile_step.py --batch "${PROFILE_BATCH:-1024}" --steps 5 \
    --out "$out/prof" \
    > "$out/profile_step.log" 2>&1
  echo "rc=$?"; tail -1 "$out/profile_step.log" | cut -c1-300; pack
fi
if want attention; then
  echo "== attention $(date +%T)"
  timeout 200 "$py" -m benchmarks.kernels.kernels_attention --out "$out/attn" --batches 1024 2048 \
    --contexts 192 1024 --prefill-sweep-s 80 > "$out/kernels_attention.log" 2>&1
  echo "rc=$?"; grep -i "prefill" "$out/kernels_attention.log" | tail -5 | cut -c1-200; pack
fi
