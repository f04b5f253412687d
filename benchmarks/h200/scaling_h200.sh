#!/usr/bin/env bash
# Issue 20, part A: W1 scaling over the GPUs of one host (nvidia-h200-x2 / -x4 / -x8). First the
# collectives' bandwidth on the machine itself (comm_bandwidth, every GPU), then qwen3-30b-a3b
# (bf16, dummy) through `moeserve serve` + `moeserve bench --diagnose` at PER_GPU streams per
# GPU on each world size W of WORLDS, in each parallel MODE:
#   tp    attention, dense and MoE split W ways (MoE TP W)
#   ep    attention and dense TP W, the routed experts split across ranks (EP W)
#   mix   MoE TP 2 x EP W/2 (W >= 4)
# W 1 runs once (no split). Every process keeps NVLink multicast off (the device README). The
# host is sized so that it is not what is measured: a request pool of the run's streams, one
# API server and one bench client process per 2,048 streams. Each server samples a step
# profile every 32 steps (`--step-profile-every`: its "comm" phase is the step's collectives)
# and the bench's JSON carries /v1/engine's counters and the doctor's verdicts. Results:
# $OUT/scaling/comm_bandwidth.json, w1_<mode>_w<W>_c<C>.jsonl + .log, and summary.txt (output
# tok/s per GPU against one GPU's at the same streams per GPU).
#   bash benchmarks/h200/scaling_h200.sh                     # every W up to the GPUs here
#   WORLDS="1 2" MODES="tp ep" PER_GPU=1024 bash benchmarks/h200/scaling_h200.sh
#   SMOKE=1 bash benchmarks/h200/scaling_h200.sh             # tiny-moe on CPU (gloo), tiny
#                                                            # loads: the script's own checks
# One call holds 10 minutes: at about 1.5 minutes a run, split WORLDS / MODES / PER_GPU over
# calls (the summary reads every run under $OUT/scaling, and W 1 is the baseline it needs).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "${SMOKE:-}" ]; then
  OUT=${OUT:-/tmp/scaling_smoke}; PY=${PYTHON:-.venv/bin/python}
  preset=tiny-moe; extra="--device cpu"; gpus=2; limit=${LIMIT:-240}
  per_gpu=${PER_GPU:-4}; comm=(--cpu --world 2 --iters 2 --warmup 1)
else
  source benchmarks/gpu_env.sh; PY=python3
  preset=${PRESET:-qwen3-30b-a3b}; extra=""; gpus=$(nvidia-smi -L | wc -l); limit=${LIMIT:-200}
  per_gpu=${PER_GPU:-1024 2048}; comm=(--world "$gpus")
fi
out=$OUT/scaling
mkdir -p "$out"
worlds=${WORLDS:-$(for w in 1 2 4 8; do [ "$w" -le "$gpus" ] && echo -n "$w "; done)}
if [ ! -f "$out/comm_bandwidth.json" ]; then
  timeout 240 $PY -m benchmarks.parallel.comm_bandwidth --out "$out" "${comm[@]}" \
    > "$out/comm_bandwidth.log" 2>&1
  echo "comm_bandwidth rc=$?"; tail -3 "$out/comm_bandwidth.log"
fi
for w in $worlds; do
  [ "$w" -gt "$gpus" ] && { echo "W $w: only $gpus GPUs here, skipped"; continue; }
  for mode in ${MODES:-tp ep mix}; do
    case $mode in
      tp) par="--tp $w" ;;
      ep) par="--tp $w --enable-expert-parallel" ;;
      mix) par="--tp $w --expert-parallel-size $((w / 2))" ;;
      *) echo "unknown mode $mode (tp, ep, mix)"; exit 2 ;;
    esac
    [ "$w" = 1 ] && [ "$mode" != tp ] && continue  # one GPU: nothing to split
    [ "$mode" = mix ] && [ "$w" -lt 4 ] && continue
    for per in $per_gpu; do
      c=$((per * w)); hosts=$(( (c + 2047) / 2048 ))
      name="w1_${mode}_w${w}_c${c}"
      echo "== $name: $par, $hosts API server(s) / bench workers $(date +%T)"
      timeout "$limit" $PY -m moeserve.cli bench --preset "$preset" --max-concurrency "$c" \
        --workers "$hosts" --diagnose --no-progress --output-json "$out/$name.jsonl" \
        --server-args "$par $extra --api-servers $hosts --request-pool $c --step-profile-every 32" \
        > "$out/$name.log" 2>&1
      echo "rc=$?"
      grep -E "Output token throughput|serial roofline|eager decode|Error" "$out/$name.log" | head -4
    done
  done
done
$PY -m benchmarks.parallel.scaling_summary "$out" | tee "$out/summary.txt"
