#!/usr/bin/env bash
# Issue 20, part B, on nvidia-h200-x8: the seeds' deployment, GLM-5 in NVFP4 (dummy weights) on
# eight GPUs, through `moeserve serve` + `moeserve bench --diagnose` (the doctor's verdicts in
# each log), then `moeserve report` over the runs (report.md and its plots). One server a
# configuration serves all of its concurrencies (start-up is the expensive part), so each
# sub-command is one GPU call (10 minutes):
#   bash benchmarks/h200/glm5_x8_h200.sh w1 tp      # MoE TP 8 (SGLang's --tp 8), W1 at CONC
#                                                   # (default 256 512 1024 2048)
#   bash benchmarks/h200/glm5_x8_h200.sh w1 ep      # TP 8 with EP 8
#   bash benchmarks/h200/glm5_x8_h200.sh w3         # W3: 32k prompts, 256 out, 64 at 32 streams
#   bash benchmarks/h200/glm5_x8_h200.sh dsv3 tp|ep # deepseek-v3 in FP8, W1 at 1,024 and 2,048
#   bash benchmarks/h200/glm5_x8_h200.sh cap 64     # the seeds' finding 1: --max-running-requests
#                                                   # 64 (then "cap auto"), W1 at 1,024
#   bash benchmarks/h200/glm5_x8_h200.sh steps 1    # finding 2: decode steps per round 1 (then
#                                                   # 4), W1 at 1,024
# Each run's JSON (the 8-GPU serial roofline printed beside it by the bench) and log go to
# $OUT/x8/<name>.jsonl / .log; the report to $OUT/x8/report_<name>/. Every process keeps NVLink
# multicast off (the device README). Commit the per-rank MoE tiles first
# (rank_tiles_h200.sh) so that no server tunes at start-up.
set -uo pipefail
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=$OUT/x8
mkdir -p "$out"
par_of() {  # tp | ep -> the parallel flags
  case ${1:-tp} in
    tp) echo "--tp 8" ;;
    ep) echo "--tp 8 --enable-expert-parallel" ;;
    *) echo "unknown split $1 (tp, ep)" >&2; exit 2 ;;
  esac
}
run() {  # name preset "server args" bench args...
  local name=$1 preset=$2 server=$3; shift 3
  echo "== $name: $server $* $(date +%T)"
  timeout "${LIMIT:-560}" python3 -m moeserve.cli bench --preset "$preset" --diagnose \
    --no-progress --output-json "$out/$name.jsonl" --server-args "$server" "$@" \
    > "$out/$name.log" 2>&1
  echo "rc=$?"
  grep -E "Output token throughput|Median TPOT|serial roofline|eager decode|Error" \
    "$out/$name.log" | head -12
  python3 -m moeserve.cli report --out "$out/report_$name" "$out/$name.jsonl" \
    > "$out/report_$name.log" 2>&1 || echo "report failed: $out/report_$name.log"
}
case "${1:?usage: glm5_x8_h200.sh w1 tp|ep | w3 | dsv3 tp|ep | cap 64|auto | steps N}" in
  w1)
    run "w1_glm-5_nvfp4_${2:-tp}" glm-5 "--quantization nvfp4 $(par_of "${2:-tp}") \
      --api-servers 2" --workers 2 --max-concurrency ${CONC:-256 512 1024 2048} ;;
  w3)
    run w3_glm-5_nvfp4_tp glm-5 "--quantization nvfp4 $(par_of tp) --max-model-len 33280" \
      --input-len 32768 --output-len 256 --num-prompts 64 --max-concurrency 32 ;;
  dsv3)
    run "w1_deepseek-v3_fp8_${2:-tp}" deepseek-v3 "--quantization fp8 $(par_of "${2:-tp}") \
      --api-servers 2" --workers 2 --max-concurrency ${CONC:-1024 2048} ;;
  cap)
    run "w1_glm-5_nvfp4_cap${2:?cap 64|auto}" glm-5 "--quantization nvfp4 $(par_of tp) \
      --max-running-requests $2" --max-concurrency 1024 ;;
  steps)
    run "w1_glm-5_nvfp4_steps${2:?steps N}" glm-5 "--quantization nvfp4 $(par_of tp) \
      --num-continuous-decode-steps $2" --max-concurrency 1024 ;;
  *) echo "unknown sub-command $1"; exit 2 ;;
esac
gzip -f "$out"/*.jsonl
