#!/usr/bin/env bash
# Issue 17: W1 on the glm-5 slice (3 dense + 3 MoE layers at GLM-5's widths, bf16, dummy,
# default MoE tiles), DeepSeek Sparse Attention (--dsa auto) alternating with dense MLA forced
# (--dsa dense), REPS rounds (default 3): at W1's 256-token contexts (below index_topk 2,048)
# DSA selects everything and the dense path runs, so the two should match (the issue: medians
# within 3%). A server start a run (--dsa is a server flag); --max-model-len 4096 keeps each
# start's memory-plan profile short. Each run's JSON goes to $OUT as it finishes.
#   bash benchmarks/h200/w1_dsa_slice_h200.sh      # CONC (default 256), PROMPTS (default 2C)
set -uo pipefail
source benchmarks/gpu_env.sh
out=$OUT/w1_dsa_slice
mkdir -p "$out" /tmp/w1s
conc=${CONC:-256}
layers='{"num_hidden_layers": 6}'
for rep in $(seq "${REPS:-3}"); do
  for mode in auto dense; do
    name="w1_glm-5_c${conc}_${mode}_r${rep}"
    timeout "${LIMIT:-150}" python3 -m moeserve.cli bench --preset glm-5 \
      --server-args="--hf-overrides '$layers' --dsa $mode --moe-tiles default --max-model-len 4096" \
      --input-len 128 --output-len 128 --num-prompts "${PROMPTS:-$((2 * conc))}" \
      --max-concurrency "$conc" --no-progress --output-json "/tmp/w1s/$name.jsonl" \
      > "$out/$name.log" 2>&1
    echo "$name rc=$? $(grep -E 'Output token throughput' "$out/$name.log" | tr -s ' ')"
    python3 benchmarks/engine/split_runs.py "/tmp/w1s/$name.jsonl" "$out" "$name" > /dev/null
  done
done
