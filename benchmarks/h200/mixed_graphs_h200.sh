#!/usr/bin/env bash
# Issue 14 on the H200 (qwen3-30b-a3b, dummy bf16): mixed steps through the piecewise CUDA graphs
# (--mixed-cuda-graphs) against the eager mixed steps of the defaults. One GPU call per
# invocation; everything goes to /tmp/i14 and comes back as $OUT/issue14.tgz (a call returns at
# most 8 files).
#   bash benchmarks/h200/mixed_graphs_h200.sh host        # the host's schedule + update at 2,048 rows,
#                                                    # start-up cold/warm with mixed graphs, and
#                                                    # the step parts at 1,024 (~5 min)
#   REP=1 bash benchmarks/h200/mixed_graphs_h200.sh w1    # W1 at CONC (default 256 512 1024 2048):
#                                                    # the defaults, then mixed graphs, each on a
#                                                    # fresh server (~5 min); REP=2, 3 the repeats
#   bash benchmarks/h200/mixed_graphs_h200.sh long        # item 3's long prompts (8,192 in, 256 out,
#                                                    # 128 at c128, --diagnose): the defaults,
#                                                    # then mixed graphs; and the prefill
#                                                    # attention at 8k context (~5 min)
#   bash benchmarks/h200/mixed_graphs_h200.sh fp8         # the float8 KV cache: its GPU tests, the
#                                                    # GQA decode at 1,024 / 2,048 rows over an
#                                                    # e4m3 pool, the MLA decode (20 / 64 heads)
#                                                    # over an e4m3 latent cache, the long
#                                                    # prompts with
#                                                    # --kv-cache-dtype fp8 beside the defaults
#                                                    # (~7 min; LONG_FLAGS= skips the long
#                                                    # prompts, LONG_FLAGS=--kv-cache-dtype=fp8
#                                                    # runs only the fp8 arm)
#   bash benchmarks/h200/mixed_graphs_h200.sh attention   # the paged attention's GPU tests, then
#                                                    # kernels_attention: decode table, prefill
#                                                    # cases, the long and W1 prefill tile sweeps
#                                                    # and the decode sweep (~5 min)
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/i14
mkdir -p "$R"
case "${1:?usage: mixed_graphs_h200.sh host|w1|long|attention|fp8}" in
  host)
    timeout 150 python3 -m benchmarks.engine.engine_loop_cpu --running 2048 --tag gpu_host --out "$R" \
      > "$R/engine_loop.log" 2>&1; echo "engine_loop rc=$?"; tail -3 "$R/engine_loop.log"
    timeout 240 python3 -m benchmarks.engine.startup --preset qwen3-30b-a3b --runs 2 --out "$R" \
      --engine-args '{"mixed_cuda_graphs": true}' > "$R/startup.log" 2>&1
    echo "startup rc=$?"; tail -3 "$R/startup.log"
    for flag in "" --mixed-cuda-graphs; do
      timeout 180 python3 -m benchmarks.engine.profile_step --batch 1024 --steps 6 $flag \
        --tag "${flag:+_mixed}" --out "$R" > "$R/profile_step${flag:+_mixed}.log" 2>&1
      echo "profile_step $flag rc=$?"; grep -E "step at batch" "$R/profile_step${flag:+_mixed}.log"
    done ;;
  w1)
    VARIANTS="baseline mixed" bash benchmarks/h200/w1_levers.sh "$R/w1_rep${REP:-1}" \
      ${CONC:-256 512 1024 2048} ;;
  long)
    for flag in "" --mixed-cuda-graphs; do
      tag=${flag:+_mixed}
      timeout 270 python3 -m moeserve.cli bench --preset qwen3-30b-a3b --input-len 8192 \
        --output-len 256 --max-concurrency 128 --num-prompts 128 --server-args="$flag" \
        --diagnose --no-progress --output-json "$R/long$tag.jsonl" > "$R/long$tag.log" 2>&1
      echo "long ${flag:-(defaults)} rc=$?"
      grep -E "Input token throughput|Output token throughput|Median TTFT" "$R/long$tag.log"
    done
    timeout 150 python3 -m benchmarks.kernels.kernels_attention --out "$R" --no-sweep \
      > "$R/kernels_attention.log" 2>&1
    echo "kernels_attention rc=$?"; grep -iE "prefill.*8192|8k" "$R/kernels_attention.log" | head ;;
  fp8)
    timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
      tests/kernels/attention/test_kv_fp8.py tests/engine/test_kv_cache_fp8.py \
      > "$R/gpu_tests_fp8.log" 2>&1
    echo "fp8 GPU tests rc=$?"; tail -1 "$R/gpu_tests_fp8.log"
    timeout 120 python3 -m benchmarks.kernels.kernels_attention --out "$R/fp8" --no-sweep \
      --kv-cache-dtype fp8 --batches 1024 2048 > "$R/kernels_attention_fp8.log" 2>&1
    echo "kernels_attention fp8 rc=$?"; grep -E "^ +[0-9]|^prefill" "$R/kernels_attention_fp8.log"
    timeout 100 python3 -m benchmarks.kernels.mla.kernels_mla --out "$R/mla_fp8" --heads 20 64 \
      --kv-cache-dtype fp8 > "$R/kernels_mla_fp8.log" 2>&1
    echo "kernels_mla fp8 rc=$?"; tail -2 "$R/kernels_mla_fp8.log"
    for flag in ${LONG_FLAGS---kv-cache-dtype=fp8 ""}; do
      tag=${flag:+_fp8}
      timeout 240 python3 -m moeserve.cli bench --preset qwen3-30b-a3b --input-len 8192 \
        --output-len 256 --max-concurrency 128 --num-prompts 128 --server-args="$flag" \
        --diagnose --no-progress --output-json "$R/long$tag.jsonl" > "$R/long$tag.log" 2>&1
      echo "long ${flag:-(defaults)} rc=$?"
      grep -E "Input token throughput|Output token throughput|Median TTFT|KV cache " \
        "$R/long$tag.log"
    done ;;
  attention)
    timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
      tests/kernels/attention/test_paged_attention_triton.py > "$R/gpu_tests_paged.log" 2>&1
    echo "paged attention GPU tests rc=$?"; tail -1 "$R/gpu_tests_paged.log"
    timeout 200 python3 -m benchmarks.kernels.kernels_attention --out "$R/long" \
      --prefill-cases long --no-decode-sweep --prefill-sweep-s 110 --batches 1024 2048 \
      > "$R/kernels_attention_long.log" 2>&1
    echo "kernels_attention long rc=$?"; grep -E "^prefill|best" "$R/kernels_attention_long.log"
    timeout 200 python3 -m benchmarks.kernels.kernels_attention --out "$R/w1" \
      --prefill-cases w1 --prefill-sweep-s 60 --batches 256 2048 --contexts 192 4096 \
      > "$R/kernels_attention_w1.log" 2>&1
    echo "kernels_attention w1 rc=$?"; grep -E "best|^ +[0-9]" "$R/kernels_attention_w1.log" ;;
esac
tar czf "$OUT/issue14.tgz" -C /tmp i14
