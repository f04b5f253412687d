#!/usr/bin/env bash
# Issue 18's W1 check through the server: qwen3-30b-a3b with dummy weights, bf16, then every
# projection quantized (`--quantization fp8`, then `--quantization nvfp4`), each format one
# `moeserve bench` (its own server; CUDA graphs and overlap scheduling on, the defaults) over
# the concurrencies CONCS (default 256 512 1024 2048), one call. A format with the suffix "dl"
# (FORMATS="bf16 nvfp4 nvfp4dl") quantizes the routed experts alone (--dequantize-linears: the
# other projections dequantized into bf16 as they load; its targets are the format's); the
# suffix "rows" (nvfp4dlrows) keeps the 4-bit experts in rows (--moe-weight-layout rows: the
# A/B of the micro-tiled default). Each run's JSON (without the
# per-request records; with the server's capacity report, resolved config and `serial_bound`,
# whose `weights` names the format) goes to OUT/runs/w1_<format>_c<C>.json, each format's log
# to OUT/w1_<format>.log; benchmarks/quant/quant_compare.py then writes OUT/compare.json (output
# tok/s, share of the format's serial bound, ratio to bf16, the issue's targets).
# ORDER=abba runs the formats, then each again in reverse (A B B A: the second of two W1 runs
# back to back was ~3% faster whichever it was, gpu_43c198d), the second runs as _run2 and
# quant_compare taking each format's median (here the mean of its two) at twice the time.
# BUDGET_S (default 520) bounds the call: each run gets an equal share of what is left, and
# one past its share is stopped with SIGINT (the bench then stops its server; the runs it
# finished are kept). Expect ~7-8 minutes with 2048 (bf16 ~1.5, each quantized format ~2.5-3
# with start-up: dummy quantization, kernel compiles, graph capture); CONCS="256 512 1024"
# saves ~1.5. The GPU machine returns few files: write OUT outside $OUT and tar it into $OUT.
# Every server gets --moe-tune-budget-s ${MOE_TUNE_BUDGET_S:-0}: a start-up tune of the
# quantized experts' tiles (up to 240 s a format when no tuned file is found) does not fit the
# call, so they run a tuned file the lookup finds (committed, or in MOESERVE_MOE_CONFIG_DIR,
# e.g. the --out of an earlier `python -m moeserve.kernels.moe.quant.tune` call on the same
# warm machine) or their in-code defaults; each run's capacity report (and compare.json's
# moe_tile_sources) says which.
#
#   source benchmarks/gpu_env.sh; bash benchmarks/h200/quant_w1_h200.sh /tmp/qw1; \
#       tar czf $OUT/quant_w1.tgz -C /tmp qw1
#   PRESET=glm-5 SERVER_ARGS="--hf-overrides '{\"num_hidden_layers\": 20}' --max-model-len 4096" \
#       FORMATS=nvfp4 CONCS=1024 bash benchmarks/h200/quant_w1_h200.sh /tmp/qw1g5
#       # SERVER_ARGS: more server flags for every format, split as a shell would (shlex)
#   PYTHON=.venv/bin/python PRESET=tiny-moe CONCS=4 bash benchmarks/h200/quant_w1_h200.sh /tmp/qw1
#       # CPU smoke (tiny-moe's quantized projections through the CPU fallbacks)
set -uo pipefail
out=${1:?usage: quant_w1_h200.sh OUT}
mkdir -p "$out"
out=$(realpath "$out")
py=${PYTHON:-python3}
formats=(${FORMATS:-bf16 fp8 nvfp4})
order=("${formats[@]}")
if [ "${ORDER:-once}" = abba ]; then  # then each format again, in reverse: A B B A
  for ((j = ${#formats[@]} - 1; j >= 0; j--)); do order+=("${formats[$j]}"); done
fi
declare -A passes
budget=${BUDGET_S:-520}
start=$SECONDS
for i in "${!order[@]}"; do
  fmt=${order[$i]}
  passes[$fmt]=$(( ${passes[$fmt]:-0} + 1 ))
  pass=${passes[$fmt]}
  left=$(( budget - (SECONDS - start) ))
  share=$(( left / (${#order[@]} - i) ))
  if [ "$share" -lt 60 ]; then echo "== $fmt skipped: ${left}s left"; continue; fi
  flags="--moe-tune-budget-s ${MOE_TUNE_BUDGET_S:-0} ${SERVER_ARGS:-}"
  base=${fmt%rows}  # "rows": the 4-bit experts in the row layout (not micro-tiled)
  [ "$base" != "$fmt" ] && flags="--moe-weight-layout rows $flags"
  case $base in
    bf16) ;;
    *dl) flags="--quantization ${base%dl} --dequantize-linears $flags";;  # experts only
    *) flags="--quantization $base $flags";;
  esac
  name="w1_$fmt"
  [ "$pass" -gt 1 ] && name="w1_${fmt}_pass$pass"
  echo "== $name ($flags, at most ${share}s) $(date +%T)"
  # SIGINT, not SIGTERM: the bench's KeyboardInterrupt stops the server it started
  timeout -s INT -k 30 "$share" "$py" -m moeserve.cli bench --preset "${PRESET:-qwen3-30b-a3b}" \
    --max-concurrency ${CONCS:-256 512 1024 2048} --server-args="$flags" --no-progress \
    --output-json "$out/$name.jsonl" > "$out/$name.log" 2>&1
  echo "rc=$? after $(( SECONDS - start ))s"
  grep -E "Max request concurrency|Output token throughput|serial roofline" "$out/$name.log"
  if [ -s "$out/$name.jsonl" ]; then
    split="$out/runs"
    [ "$pass" -gt 1 ] && split="$out/runs_pass$pass"
    "$py" benchmarks/engine/split_runs.py "$out/$name.jsonl" "$split" "w1_$fmt" > /dev/null \
      && rm -f "$out/$name.jsonl"
    if [ "$pass" -gt 1 ]; then  # w1_<fmt>_c<C>.json -> runs/w1_<fmt>_c<C>_run<pass>.json
      mkdir -p "$out/runs"
      for f in "$split"/*.json; do
        [ -e "$f" ] && mv "$f" "$out/runs/$(basename "${f%.json}")_run$pass.json"
      done
      rmdir "$split"
    fi
  fi
done
"$py" benchmarks/quant/quant_compare.py "$out/runs" "$out/compare.json"
