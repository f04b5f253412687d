#!/usr/bin/env bash
# Issue 13's H200 study: `moeserve tune` on qwen3-30b-a3b, W1 at concurrency 1,024, from the
# seeds' bad start (admission cap 64, default MoE tiles, eager, no overlap scheduling). One GPU
# call per invocation; the ledger (SQLite) lives in the checkout, so the next call, carried the
# file back, resumes it.
#   bash benchmarks/h200/tune_h200.sh PHASES WALL_SECONDS|auto [GPU_TESTS=0|1] [LIMIT_SECONDS] [ARMS]
# ARMS: the confirmation's arms, in turn (default best,start,defaults: the tune's best judged
# against the start and against the engine's defaults in one interleaved confirmation).
# The ledger is copied to $OUT/tune.db and used there, so that what a call wrote comes back
# even if the call is cut. The confirmation and the ablation start no run that would end past
# LIMIT_SECONDS (default 560; `--time-limit`, exit 3) and resume run by run in the next call;
# the tune gets SIGINT (a clean stop) at the limit as a backstop.
# Writes $OUT/tune (report, logs), $OUT/tune.db, $OUT/tune.log.
# Another study: PRESET, START (the start's flags; "" = the engine's defaults), STUDY and SRC
# (the ledger in the checkout) from the environment, e.g. mixtral from its defaults:
#   PRESET=mixtral-8x7b START= STUDY=mixtral-c1024-defaults \
#     SRC=benchmarks/results/tune_mixtral_c1024/tune.db bash benchmarks/h200/tune_h200.sh search auto
set -uo pipefail
PHASES=${1:-search}
WALL=${2:-450}
GPU_TESTS=${3:-0}
LIMIT=${4:-560}
ARMS=${5:-best,start,defaults}
T0=$(date +%s)
PRESET=${PRESET:-qwen3-30b-a3b}
START=${START---max-running-requests 64 --moe-tiles default --enforce-eager --no-async-scheduling}
STUDY=${STUDY:-qwen3-c1024-bad-start}
SRC=${SRC:-benchmarks/results/tune_qwen3_c1024/tune.db}
# the knobs searched: the qwen3 study was made before the quantization knob existed (a resumed
# study must search the same space); KNOBS= (empty) searches every knob of the device
KNOBS=${KNOBS-max_running_requests,async_scheduling,num_continuous_decode_steps,\
max_num_batched_tokens,prefill_batch_delay_steps,enforce_eager,cuda_graph_max_batch_size,\
moe_backend,moe_tiles,mem_fraction,block_size}
DB=$OUT/tune.db
mkdir -p "$OUT"
[ -f "$SRC" ] && cp "$SRC" "$DB"
GPU_ENV_VERSIONS=optuna source benchmarks/gpu_env.sh
if [ "$GPU_TESTS" = 1 ]; then
  run_gpu_tests 300
fi
LEFT=$((LIMIT - ($(date +%s) - T0)))
[ "$WALL" = auto ] && WALL=$((LEFT - 110))  # no new trial in the last 110 s
timeout -s INT "$LEFT" python3 -m moeserve.cli tune --preset "$PRESET" --max-concurrency 1024 \
  --start "$START" ${KNOBS:+--knobs "$KNOBS"} --storage "sqlite:///$DB" --study-name "$STUDY" --n-trials 40 \
  --wall-time "$WALL" --time-limit "$((LEFT - 5))" --phases "$PHASES" --confirm-runs 3 --confirm-arms "$ARMS" \
  --trial-timeout 240 --server-timeout 300 --recover-running --out "$OUT/tune" \
  2>&1 | tee "$OUT/tune.log" | tail -60
