#!/usr/bin/env bash
# W1 through the server, once per engine lever, at the concurrencies given (default 1024 2048):
# the baseline, prefill batching (--prefill-batch-delay-steps), two API processes, and
# multi-step decode (--num-continuous-decode-steps, which turns overlap scheduling off), and a
# prefill chunk of 16,384 tokens (chunk16k; not in the default list), and mixed steps through
# the piecewise CUDA graphs (mixed; not in the default list either). Each
# variant starts its own server (`moeserve bench` without --url) and appends its runs, with the
# server's capacity report and resolved config, to OUT/w1_levers.jsonl, then each run goes to a
# JSON of its own without the per-request records (benchmarks/engine/split_runs.py). One GPU call, ~5-6 minutes. The
# GPU machine returns at most 8 files: write OUT outside $OUT and tar it into $OUT.
#
#   MOESERVE_GIT_COMMIT=<sha> bash benchmarks/h200/w1_levers.sh /tmp/w1l [concurrency ...]; \
#       tar czf $OUT/w1_levers.tgz -C /tmp w1l
#   PYTHON=.venv/bin/python PRESET=tiny-moe bash benchmarks/h200/w1_levers.sh /tmp/w1l 4   # CPU smoke
#   VARIANTS="baseline multistep4" bash benchmarks/h200/w1_levers.sh /tmp/w1l 256 512 1024 2048
set -uo pipefail
out=${1:?usage: w1_levers.sh OUT [concurrency ...]}
shift
conc=("${@:-1024 2048}")
mkdir -p "$out"
declare -A variants=(
  [baseline]=""
  [prefill_delay8]="--prefill-batch-delay-steps 8"
  [api2]="--api-servers 2"
  [multistep4]="--num-continuous-decode-steps 4"
  [chunk16k]="--max-num-batched-tokens 16384"
  [mixed]="--mixed-cuda-graphs"
)
for name in ${VARIANTS:-baseline prefill_delay8 api2 multistep4}; do
  [ -n "${variants[$name]+set}" ] || { echo "unknown variant $name (${!variants[*]})"; exit 2; }
  echo "== $name: ${variants[$name]:-(defaults)} $(date +%T)"
  "${PYTHON:-python3}" -m moeserve.cli bench --preset "${PRESET:-qwen3-30b-a3b}" --max-concurrency ${conc[*]} \
    --server-args="${variants[$name]}" --no-progress \
    --output-json "$out/w1_levers_$name.jsonl" > "$out/w1_levers_$name.log" 2>&1
  echo "rc=$?"
  grep -E "Max request concurrency|Output token throughput" "$out/w1_levers_$name.log"
  "${PYTHON:-python3}" benchmarks/engine/split_runs.py "$out/w1_levers_$name.jsonl" "$out/runs" "w1_$name" \
    > /dev/null && rm -f "$out/w1_levers_$name.jsonl"
done
