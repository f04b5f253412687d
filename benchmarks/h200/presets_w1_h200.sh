#!/usr/bin/env bash
# Issue 15's H200 acceptance for the DeepSeek / Kimi / GLM presets: each starts with dummy
# weights (sliced by --hf-overrides where the whole model does not fit one H200 in bf16) and
# the untuned default MoE tiles (--moe-tiles default: no start-up tune of new shapes), and
# serves W1 at concurrency 256 through `moeserve serve`; the bench's JSON (with the server's
# capacity report, /v1/engine's eager decode fallbacks and its resolved config) goes to
# $OUT/presets_w1/<preset>.jsonl, its log beside it. One GPU call runs the presets given
# (default: all; expect one to three minutes each: start-up compiles the new shapes' kernels),
# so three calls cover the seven:
#   bash benchmarks/h200/presets_w1_h200.sh deepseek-v2-lite moonlight-16b-a3b glm-4.7-flash
#   bash benchmarks/h200/presets_w1_h200.sh glm-4.5-air glm-4.5
#   bash benchmarks/h200/presets_w1_h200.sh deepseek-v3 kimi-k2
# GPU_TESTS=1 runs `pytest -m gpu` over the test tree first ($OUT/gpu_tests.log). CONC=N serves
# at concurrency N (default 256; files then named <preset>_cN), and TILES=committed uses the
# committed H200 MoE tiles instead of the defaults (issue 16's W1 at 1,024 on moonlight and the
# sliced glm-4.5-air:  CONC=1024 TILES=committed bash ... moonlight-16b-a3b glm-4.5-air).
set -uo pipefail
presets=("${@:-deepseek-v2-lite moonlight-16b-a3b glm-4.7-flash glm-4.5-air glm-4.5 deepseek-v3 kimi-k2}")
# layers kept where bf16 weights would not fit (the first layers dense, as published)
declare -A slice=(
  [glm-4.5-air]='{"num_hidden_layers": 16}'
  [glm-4.5]='{"num_hidden_layers": 10}'
  [deepseek-v3]='{"num_hidden_layers": 5}'
  [kimi-k2]='{"num_hidden_layers": 3}'
)
out=$OUT/presets_w1
mkdir -p "$out"
source benchmarks/gpu_env.sh
if [ "${GPU_TESTS:-0}" = 1 ]; then
  run_gpu_tests 420
fi
conc=${CONC:-256}
tag=""; [ "$conc" != 256 ] && tag=_c$conc
for p in ${presets[*]}; do
  args=""; [ "${TILES:-default}" = default ] && args="--moe-tiles default"
  [ -n "${slice[$p]+set}" ] && args="$args --hf-overrides '${slice[$p]}'"
  echo "== $p: $args $(date +%T)"
  timeout 240 python3 -m moeserve.cli bench --preset "$p" --max-concurrency "$conc" \
    --server-args "$args" --no-progress --output-json "$out/$p$tag.jsonl" > "$out/$p$tag.log" 2>&1
  echo "rc=$?"
  grep -E "Output token throughput|serial roofline|eager decode|Error|error" "$out/$p$tag.log" | head -5
done
