#!/usr/bin/env bash
# Structured outputs' cost on W1 through the server (qwen3-30b-a3b, bf16, dummy weights, the
# byte tokenizer): plain W1 against W1 with every request held to a grammar whose output is
# exactly W1's 128 tokens, so lengths stay W1's: a regex of 128 letters, and a JSON schema of
# one 120-character string. What it measures: the masks' host time (llguidance) and what is left
# of overlap scheduling on the steps that hold a grammar (their forward is enqueued before the
# step before settles; num_grammar_waits counts them). NOTE: the byte tokenizer has 256 text
# tokens, a real one ~150k: the masks cost more there (mask_cost.py, first, times them at a
# ~115k vocabulary on this host's cores). Into DIR (default /tmp/structured), packed as $OUT/structured.tgz.
#   bash benchmarks/h200/structured_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
dir=${1:-/tmp/structured}
mkdir -p "$dir"
# the masks' host cost at a ~115k vocabulary, one at a time, on this host's cores (the engine
# builds them while the step's forward runs)
timeout 120 python3 -m benchmarks.structured.mask_cost --rows 64 256 1024 \
  --out "$dir/mask_cost" > "$dir/mask_cost.log" 2>&1
echo "mask_cost rc=$?"
python3 -c "import json, sys; [print(r) for r in json.load(open(sys.argv[1]))['runs']]" \
  "$dir/mask_cost/mask_cost.json"
regex='{"structured_outputs": {"regex": "[a-z]{128}"}}'
schema='{"response_format": {"type": "json_schema", "json_schema": {"name": "w1", "schema":
 {"type": "object", "required": ["t"], "additionalProperties": false, "properties":
 {"t": {"type": "string", "pattern": "^[a-z]{120}$"}}}}}}'
for c in ${CONC:-256 1024}; do
  w1_run qwen3-30b-a3b "$c" "plain_c$c" "$dir"
  W1_EXTRA_BODY=$regex w1_run qwen3-30b-a3b "$c" "regex_c$c" "$dir"
  W1_EXTRA_BODY=$schema w1_run qwen3-30b-a3b "$c" "schema_c$c" "$dir"
  [ -n "${OUT:-}" ] && tar czf "$OUT/structured.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
done
grep -h "num_grammar_waits" "$dir"/*.jsonl | head -3
