#!/usr/bin/env bash
# Session 34's changes, measured in one call (~5 min): the GPU tests of what changed (the swapped
# Gluon MLA decode now one key stage by default, its tokens form removed; the NVFP4 variants
# without the Gluon tiles; structured outputs' engine tests), W1 on glm-4.7-flash at 1,024 with
# the one-stage decode (issue 16's 60% target; 51.7% in gpu_4705423 with two stages), and W1
# qwen3-30b-a3b at 1,024 under a regex and under a JSON schema (gpu_ff7b345/call3: 16,850 and
# 19,407 output tok/s against 23,858 plain, with 8.1 / 1.8 ms of each loop iteration in intake,
# the grammars' re-validation per request, now skipped for a compiled grammar; and since
# bdccbac each grammar step's masks on a thread of their own, beside the loop's other host
# work; the regex run again with MOESERVE_GRAMMAR_MASKS_THREAD=0, masks at once on the
# engine's thread, its A/B; and mask_cost --per-row: the executor call's host cost against
# the per-row calls at a ~115k vocabulary on this host), plain W1 at 1,024 in the same call as
# their baseline (~8 min in all: two calls, each under the 10-minute limit: `main` the GPU
# tests, mask_cost, W1 on glm-4.7-flash and the regex's thread / inline A/B in one call;
# `rest` plain W1 and the schema). Into DIR (default $OUT/one_stage_structured).
#   bash benchmarks/h200/one_stage_structured_h200.sh main|rest [DIR]
set -uo pipefail
part=${1:?main or rest}
source benchmarks/gpu_env.sh
dir=${2:-$OUT/one_stage_structured}
mkdir -p "$dir"
regex='{"structured_outputs": {"regex": "[a-z]{128}"}}'
schema='{"response_format": {"type": "json_schema", "json_schema": {"name": "w1", "schema":
 {"type": "object", "required": ["t"], "additionalProperties": false, "properties":
 {"t": {"type": "string", "pattern": "^[a-z]{120}$"}}}}}}'
if [ "$part" = rest ]; then
  w1_run qwen3-30b-a3b 1024 plain_c1024 "$dir"
  W1_EXTRA_BODY=$schema w1_run qwen3-30b-a3b 1024 schema_c1024 "$dir"
  gzip -f "$dir"/*.jsonl
  exit 0
fi
# the masks' host cost on this host, the executor call against the per-row reference (CPU only:
# beside the GPU tests, off the W1 runs)
timeout 240 python3 -m benchmarks.structured.mask_cost --rows 256 1024 --per-row \
  --out "$dir/mask_cost" > "$dir/mask_cost.log" 2>&1 &
masks=$!
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_decode_gluon_swapped.py \
  tests/kernels/moe/test_moe_quant_nvfp4_variants.py \
  tests/engine/test_structured_outputs.py > "$dir/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$dir/gpu_tests.log"
wait $masks; echo "mask_cost rc=$?"
W1_TIMEOUT=130 w1_run glm-4.7-flash 1024 w1_glm-4.7-flash_c1024 "$dir"
W1_EXTRA_BODY=$regex w1_run qwen3-30b-a3b 1024 regex_c1024 "$dir"
W1_EXTRA_BODY=$regex w1_run qwen3-30b-a3b 1024 regex_c1024_masks_inline "$dir" \
  MOESERVE_GRAMMAR_MASKS_THREAD=0
gzip -f "$dir"/*.jsonl
