#!/usr/bin/env bash
# W3 (issue 17): long context through `moeserve serve`: random prompts of 32,768 tokens, 256
# output tokens, exact lengths (ignore EOS), 2C prompts at concurrency C, on glm-5 sliced to one
# H200 (3 dense + 3 MoE layers at GLM-5's widths, dummy bf16 weights, default MoE tiles), each C
# with DeepSeek Sparse Attention (--dsa auto) and with dense MLA forced (--dsa dense, the
# comparison flag: no indexer runs, no indexer cache). `moeserve bench` stores and prints each
# run's serial roofline (sparse or dense reads, by the server's --dsa). One GPU call per
# (concurrency, mode) pair at 128; both modes of 32 fit one call:
#   CONC=32 bash benchmarks/h200/w3_h200.sh            # MODES="auto dense" by default
#   CONC=128 MODES=auto bash benchmarks/h200/w3_h200.sh
#   MAXLEN=model MODES=auto bash benchmarks/h200/w3_h200.sh   # at GLM-5's own max_model_len
# At 128 the 2C = 256 prompts are 8.4M prompt tokens: at the 11.7k input tok/s dense
# MLA measured at 32 (gpu_2928ff4) that alone is ~12 min, past a call's 10. PROMPTS=N runs N
# prompts instead (a stated deviation: the run's JSON records the count).
# Results: $OUT/w3/w3_glm-5_<mode>_c<C>.json (no per-request records: split_runs.py) + logs.
set -uo pipefail
source benchmarks/gpu_env.sh
out=$OUT/w3
mkdir -p "$out" /tmp/w3
conc=${CONC:-32}
layers='{"num_hidden_layers": 6}'
# MAXLEN=N sets --max-model-len (default 33,280: the prompt and output); MAXLEN=model keeps
# the model's own (GLM-5: 202,752), where the decode graphs' context bounds matter
maxlen="--max-model-len ${MAXLEN:-33280}"
[ "${MAXLEN:-}" = model ] && maxlen=""
for mode in ${MODES:-auto dense}; do
  name="w3_glm-5_c${conc}_${mode}${MAXLEN:+_len$MAXLEN}"
  echo "== $name $(date +%T)"
  timeout "${LIMIT:-280}" python3 -m moeserve.cli bench --preset glm-5 \
    --server-args="--hf-overrides '$layers' --dsa $mode --moe-tiles default $maxlen" \
    --input-len 32768 --output-len 256 --num-prompts "${PROMPTS:-$((2 * conc))}" --max-concurrency "$conc" \
    --no-progress --output-json "/tmp/w3/$name.jsonl" > "$out/$name.log" 2>&1
  echo "rc=$?"
  grep -E "Output token throughput|Median TPOT|serial roofline|eager decode" "$out/$name.log"
  python3 benchmarks/engine/split_runs.py "/tmp/w3/$name.jsonl" "$out" "w3_glm-5_$mode${MAXLEN:+_len$MAXLEN}" > /dev/null
done
