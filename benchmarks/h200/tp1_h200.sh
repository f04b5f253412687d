#!/usr/bin/env bash
# Issue 19's one-GPU check: W1 at 1,024 (qwen3-30b-a3b, bf16, dummy) through `moeserve serve`,
# the plain path against a world of one through NCCL (--distributed-at-one-rank: the sharded
# layers, the collectives inside the CUDA graphs, the control group's plan broadcast), REPS
# times each, alternating, in one call; CUDA graphs and overlap scheduling on (the defaults).
# Each run's JSON (without per-request records) goes to OUT/runs; the medians are compared by
# benchmarks/engine/tp1_compare.py. ~6 minutes. With BASE_TREE (an exported tree of an earlier commit,
# e.g. the main before issue 19, carried to the machine), the plain runs are that tree's, so
# the comparison is today's distributed path against that main.
#
#   source benchmarks/gpu_env.sh; bash benchmarks/h200/tp1_h200.sh /tmp/tp1; \
#       tar czf $OUT/tp1.tgz -C /tmp tp1
#   git archive 57e662d moeserve | (mkdir -p build/main_57e662d && tar -x -C build/main_57e662d)  # here
#   run with carry ["build/main_57e662d", ".whl"]:
#   source benchmarks/gpu_env.sh; BASE_TREE=build/main_57e662d BASE_COMMIT=57e662d bash benchmarks/h200/tp1_h200.sh /tmp/tp1
set -uo pipefail
out=${1:?usage: tp1_h200.sh OUT}
mkdir -p "$out"
out=$(realpath "$out")
for rep in $(seq 1 "${REPS:-3}"); do
  for variant in plain dist1; do
    flags=""
    [ "$variant" = dist1 ] && flags="--distributed-at-one-rank"
    name="w1_${variant}_r$rep"
    echo "== $name $(date +%T)"
    tree=$PWD commit=${MOESERVE_GIT_COMMIT:-}
    if [ "$variant" = plain ] && [ -n "${BASE_TREE:-}" ]; then
      tree=$(realpath "$BASE_TREE") commit=${BASE_COMMIT:?BASE_TREE needs BASE_COMMIT}
    fi
    # from inside the tree: `python -m` puts the working directory first on sys.path
    (cd "$tree" && MOESERVE_GIT_COMMIT=$commit PYTHONPATH="$tree:${SITE:-}" \
      "${PYTHON:-python3}" -m moeserve.cli bench --preset "${PRESET:-qwen3-30b-a3b}" \
      --max-concurrency "${CONC:-1024}" --server-args="$flags" --no-progress \
      --output-json "$out/$name.jsonl" > "$out/$name.log" 2>&1)
    echo "rc=$?"
    grep -E "Output token throughput" "$out/$name.log"
    "${PYTHON:-python3}" benchmarks/engine/split_runs.py "$out/$name.jsonl" "$out/runs" "$name" \
      > /dev/null && rm -f "$out/$name.jsonl"
  done
done
