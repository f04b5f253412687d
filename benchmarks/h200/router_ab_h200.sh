#!/usr/bin/env bash
# The sigmoid router in one Triton launch (kernels/routing/grouped_triton.py, on by default on
# CUDA since gpu_bb408cc: layers/moe.py's grouped_router_triton) on the H200 in one call (~7 minutes): its GPU tests
# (the kernel in a CUDA graph at DeepSeek-V3's shape; the softmax router's, as the two share
# _take_top_k; the engine's tokens against transformers' with it on), then W1 on PRESET
# (default glm-4.7-flash, 46 sigmoid-routed MoE layers) at CONC (default 256) through the
# server, ROUNDS (default 2) rounds alternating off / on (MOESERVE_GROUPED_ROUTER_TRITON=0 / 1
# in the server's environment). $OUT/router_ab/ (the runs' logs and records as runs.tgz: a call
# returns at most 8 files).
#   bash benchmarks/h200/router_ab_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
out=$OUT/router_ab; mkdir -p "$out"
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/test_routing_grouped_triton.py tests/kernels/test_routing_triton.py \
  > "$out/gpu_tests.log" 2>&1
echo "kernel gpu tests rc=$?"; tail -1 "$out/gpu_tests.log"
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -k grouped_router \
  tests/engine/test_mla_families_vs_hf.py >> "$out/gpu_tests.log" 2>&1
echo "engine tests (cuda) rc=$?"; tail -1 "$out/gpu_tests.log"
preset=${PRESET:-glm-4.7-flash}
for round in $(seq "${ROUNDS:-2}"); do
  for on in 0 1; do
    name="w1_${preset}_c${CONC:-256}_router${on}_r$round"
    MOESERVE_GROUPED_ROUTER_TRITON=$on timeout 110 python3 -m moeserve.cli bench \
      --preset "$preset" --max-concurrency "${CONC:-256}" --no-progress \
      --output-json "$out/$name.jsonl" > "$out/$name.log" 2>&1
    echo "$name rc=$? $(grep -E 'Output token throughput' "$out/$name.log")"
  done
done
tar czf "$out/runs.tgz" -C "$out" $(cd "$out" && ls w1_*) && rm "$out"/w1_*
