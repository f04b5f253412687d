#!/usr/bin/env bash
# decode_gluon_ws served by default past decode_gluon.WS_SHORT_CONTEXT keys, the decode CUDA
# graphs holding a graph per bucket at that bound (sessions 37-38, issue 16). Four parts, one
# call each:
#   [RUNS="main:gluon-ws ..."] [TESTS_TIMEOUT=S] bash benchmarks/h200/mla_ws_graphs_h200.sh kernels
#       ~8 min: the two-P V form's and the sparse form's GPU tests; kernels_mla at 64 and 128 heads:
#       its main cases with decode_gluon_ws in its two forms (one P V warpgroup beside the
#       scores warpgroup's half; two, `two_pv`), then --crossover (384 to 1,536 keys) with
#       decode_gluon's kernel and decode_gluon_ws; kernels_dsa --decode-only with the sparse
#       MLA by decode_gluon_ws too (the runs packed as kernels_mla_runs.tgz); then the GPU
#       tests of decode_gluon_ws, decode_gluon, the CUDA graphs and the structured OOM test
#   [WS_ORDER="1 0"] bash benchmarks/h200/mla_ws_graphs_h200.sh serve   # ~2 min a pair:
#       glm-5 sliced to 6 layers with dense MLA forced (64 heads at every context), 4,096-token prompts, 512 output
#       tokens, 256 prompts at concurrency 128, served with the warp-specialized decode (the
#       default) and with MOESERVE_MLA_DECODE_WS=0
#   bash benchmarks/h200/mla_ws_graphs_h200.sh prefill   # ~3 min: kernels_dsa_prefill (W3's
#       chunks at GLM-5's shape), the sparse MLA by decode_gluon_ws too (ws_sparse's A/B)
#   bash benchmarks/h200/mla_ws_graphs_h200.sh w1        # ~5 min: W1 at 1,024 on the same
#       slice, both ways (its rows stay within the bound: decode_gluon's graphs either way; the
#       default pays a second graph a bucket at start-up)
# Into $OUT/mla_ws_graphs/.
set -uo pipefail
source benchmarks/gpu_env.sh
dir=$OUT/mla_ws_graphs
mkdir -p "$dir"
case "${1:-}" in
  kernels)
    # the decode CUDA graphs' GPU tests (capture and replay: every graph's hidden states
    # copied into one buffer), then the two-P V form's and the sparse form's on their own,
    # briefly: a hang there (a barrier phase wrong) must not eat the call; their timings
    # only if they passed
    timeout 90 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
      tests/engine/test_cuda_graphs.py > "$dir/gpu_tests_graphs.log" 2>&1
    echo "gpu tests graphs rc=$?"; tail -3 "$dir/gpu_tests_graphs.log"
    timeout 100 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -k "two_pv or sparse" \
      tests/kernels/attention/test_mla_decode_gluon_ws.py > "$dir/gpu_tests_two_pv.log" 2>&1
    two=$?
    echo "gpu tests two_pv and sparse rc=$two"; tail -3 "$dir/gpu_tests_two_pv.log"
    runs=/tmp/mla_ws_runs  # one folder a run, packed into one tarball (a call returns 8 files)
    rm -rf "$runs"; mkdir -p "$runs"
    for run in ${RUNS:-main:gluon-ws main:gluon-ws2 crossover:gluon crossover:gluon-ws}; do
      cases=${run%%:*} form=${run#*:}
      [ "$form" = gluon-ws2 ] && [ "$two" != 0 ] && continue
      flag=""; [ "$cases" = crossover ] && flag=--crossover
      mkdir -p "$runs/${cases}_$form"
      timeout -s INT 120 python3 -m benchmarks.kernels.mla.kernels_mla --out "$runs/${cases}_$form" \
        --heads 64 128 --forms "$form" $flag > "$runs/${cases}_$form/kernels_mla.log" 2>&1
      echo "kernels_mla $run rc=$?"
    done
    python3 - "$runs" <<'PY'
import glob, json, os, sys
rows = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/*/kernels_mla.json")):
    form = os.path.basename(os.path.dirname(path)).split("_", 1)[1]
    for r in json.load(open(path))["cases"]:
        rows.setdefault((r["heads"], r["case"]), {})[form] = f'{r["ms"]:.4f} ({r["pct_of_bound"]:.1f}%)'
for (heads, case), got in sorted(rows.items()):
    print(heads, case, got)
PY
    # DSA's decode step with the sparse MLA by decode_gluon_ws (sparse_mla_ws_ms, ws2 too)
    if [ "$two" = 0 ]; then
      DSA_TIMEOUT=150 dsa_decode_run kernels_dsa "$runs"
      python3 -c "
import json
for r in json.load(open('$runs/kernels_dsa/kernels_dsa.json'))['decode']:
    b = r['read_bound_ms']
    print(r['case'], 'sparse', r['sparse_mla_ms'], 'ws', r.get('sparse_mla_ws_ms'), 'ws2',
          r.get('sparse_mla_ws2_ms'), 'step graph', r['dsa_graph_ms'], r['pct_of_bound_graph'],
          'ws', r.get('dsa_graph_ws_ms'), 'ws2', r.get('dsa_graph_ws2_ms'), 'bound', b)"
    fi
    tar czf "$dir/kernels_mla_runs.tgz" -C /tmp mla_ws_runs
    # the other GPU tests of the change, in what is left of the call (TESTS_TIMEOUT seconds,
    # 0: none): decode_gluon's (its sparse form's too), the CUDA graphs', the structured OOM
    # test, then decode_gluon_ws's one-P V decode tests
    [ "${TESTS_TIMEOUT:-200}" = 0 ] && exit 0
    timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
      tests/kernels/attention/test_mla_decode_gluon.py tests/engine/test_cuda_graphs.py \
      "tests/engine/test_structured_outputs.py::test_a_deferred_sampling_out_of_memory_loses_nothing" \
      "tests/kernels/attention/test_mla_decode_gluon_ws.py::test_gpu_decode_matches" \
      "tests/kernels/attention/test_mla_decode_gluon_ws.py::test_gpu_the_switch_routes_many_head_launches" \
      > "$dir/gpu_tests.log" 2>&1
    echo "gpu tests rc=$?"; tail -3 "$dir/gpu_tests.log"
    ;;
  serve)
    layers='{"num_hidden_layers": 6}'
    round=0  # WS_ORDER: the runs' switch values in order (default "1 0"), e.g. "0 1 0 1"
    for ws in ${WS_ORDER:-1 0}; do
      round=$((round + 1))
      name=long4k_glm-5_dense_c128_ws${ws}_r$round
      timeout 200 env MOESERVE_MLA_DECODE_WS=$ws python3 -m moeserve.cli bench --preset glm-5 \
        --server-args="--hf-overrides '$layers' --dsa dense --max-model-len 8192" \
        --input-len 4096 --output-len 512 --num-prompts 256 --max-concurrency 128 \
        --no-progress --output-json "$dir/$name.jsonl" > "$dir/$name.log" 2>&1
      echo "$name rc=$?"
      grep -E "Output token throughput|Median TPOT|serial roofline|eager decode|CUDA graphs" \
        "$dir/$name.log"
    done
    ;;
  prefill)
    # decode_gluon.ws_sparse's other half: DSA's prefill chunks (W3's) with the sparse MLA by
    # decode_gluon_ws (sparse_mla_ws_ms) against decode_gluon's kernel (sparse_mla_gluon_ms;
    # before ws_sparse was the default, b8a5462 and earlier, sparse_mla_ms)
    timeout 300 python3 -m benchmarks.kernels.mla.kernels_dsa_prefill --out "$dir/prefill" \
      > "$dir/kernels_dsa_prefill.log" 2>&1
    echo "kernels_dsa_prefill rc=$?"
    python3 -c "
import json
for r in json.load(open('$dir/prefill/kernels_dsa_prefill.json'))['prefill']:
    print(r['case'], 'sparse MLA', r['sparse_mla_ms'], 'ws', r.get('sparse_mla_ws_ms'),
          'gluon', r.get('sparse_mla_gluon_ms'), 'bound', r['sparse_mla_bound_ms'])"
    ;;
  w1)
    for ws in 1 0; do
      W1_TIMEOUT=150 w1_run glm-5 1024 w1_glm-5_dense_c1024_ws$ws "$dir" \
        MOESERVE_MLA_DECODE_WS=$ws -- --hf-overrides "'{\"num_hidden_layers\": 6}'" --dsa dense
    done
    ;;
  *)
    sed -n 2,16p "$0"; exit 2 ;;
esac
