#!/usr/bin/env bash
# Issue 16 on the H200: the MLA family served end to end (glm-4.7-flash, bf16, dummy, the
# committed MoE tiles). One GPU call per invocation; everything goes to /tmp/i16 and comes back
# as $OUT/issue16.tgz (a call returns at most 8 files).
#   bash benchmarks/h200/mla_h200.sh tests   # pytest -m gpu over the MLA / DSA kernel files and
#                                            # the MLA presets' bf16 agreement (~4 min)
#   bash benchmarks/h200/mla_h200.sh w1      # W1 at CONC (default 256 512 1024) through the
#                                            # server for each of VARIANTS (default "baseline
#                                            # mixed": the defaults, --mixed-cuda-graphs;
#                                            # "mha" / "absorbed": --mla-prefill; "gluon" / "split":
#                                            # --mla-decode gluon / split), and each
#                                            # one's decode and mixed step profile at 1,024
#                                            # rows (~3 min a variant; NO_PROFILE=1: none)
#   bash benchmarks/h200/mla_h200.sh prefill # the MLA prefill forms timed on the same steps
#                                            # (kernels_mla_prefill: AUTO_ABSORBED_MAX_CONTEXT)
#   bash benchmarks/h200/mla_h200.sh decode  # the decode kernel (kernels_mla) at each tile of
#                                            # TILES20 (20 heads) and TILESWIDE (64 and 128
#                                            # heads): the tile sweep behind default_config;
#                                            # KV=fp8: over an e4m3 latent cache
#   bash benchmarks/h200/mla_h200.sh tiles PRESET...   # tune each preset's MoE tiles at one
#                                            # engine start (BUDGET s each, default 150) and
#                                            # bring the files back to commit under
#                                            # moeserve/kernels/moe/configs/
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/i16
mkdir -p "$R"
PRESET=${PRESET:-glm-4.7-flash}
case "${1:?usage: mla_h200.sh tests|w1|prefill|decode|tiles PRESET...}" in
  decode)
    timeout 200 python3 -m benchmarks.kernels.mla.kernels_mla --out "$R/decode20" --heads 20 \
      --kv-cache-dtype "${KV:-auto}" --tiles ${TILES20:-32,64,8,3 32,32,8,4 16,64,8,3 16,32,4,3} > "$R/kernels_mla_20.log" 2>&1
    echo "kernels_mla 20 heads rc=$?"
    timeout 200 python3 -m benchmarks.kernels.mla.kernels_mla --out "$R/decode_wide" --heads 64 128 \
      --kv-cache-dtype "${KV:-auto}" --tiles ${TILESWIDE:-64,32,8,3 64,64,8,2} > "$R/kernels_mla_wide.log" 2>&1
    echo "kernels_mla 64/128 heads rc=$?"
    python3 -c "import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f))['cases']:
        t = r['tile']
        print(r['heads'], r['case'], (t['block_m'], t['block_n'], t['num_warps'], t['num_stages']), r['ms'], r['pct_of_bound'])
" "$R/decode20/kernels_mla.json" "$R/decode_wide/kernels_mla.json" ;;
  prefill)
    timeout 240 python3 -m benchmarks.kernels.mla.kernels_mla_prefill --out "$R" \
      > "$R/kernels_mla_prefill.log" 2>&1
    echo "kernels_mla_prefill rc=$?"
    python3 -c "import json, sys; [print(r['preset'], r['case'], r['mha_ms'], r['absorbed_ms'], \
r['faster']) for r in json.load(open(sys.argv[1]))['cases']]" "$R/kernels_mla_prefill.json" ;;
  tests)
    timeout 170 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
      tests/kernels/attention/test_mla_triton.py tests/kernels/attention/test_dsa_triton_gpu.py \
      tests/kernels/attention/test_dsa_triton_tiles.py \
      tests/kernels/attention/test_mla_rope_cache_triton.py > "$R/gpu_tests_kernels.log" 2>&1
    echo "kernel tests rc=$?"; tail -2 "$R/gpu_tests_kernels.log"
    timeout 60 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider -k mla \
      tests/engine/test_gpu_bf16_agreement.py > "$R/gpu_tests_agreement.log" 2>&1
    echo "agreement tests rc=$?"; tail -2 "$R/gpu_tests_agreement.log" ;;
  w1)
    declare -A flags=([baseline]="" [mixed]="--mixed-cuda-graphs" [mha]="--mla-prefill mha"
                      [absorbed]="--mla-prefill absorbed" [gluon]="--mla-decode gluon"
                      [split]="--mla-decode split")
    declare -A engine=([baseline]="{}" [mixed]="{}" [mha]='{"mla_prefill": "mha"}'
                       [absorbed]='{"mla_prefill": "absorbed"}' [gluon]='{"mla_decode": "gluon"}'
                       [split]='{"mla_decode": "split"}')
    for variant in ${VARIANTS:-baseline mixed}; do
      flag=${flags[$variant]}
      tag=_$variant
      for c in ${CONC:-256 512 1024}; do
        timeout 110 python3 -m moeserve.cli bench --preset "$PRESET" --max-concurrency "$c" \
          --server-args="$flag" --no-progress --output-json "$R/w1_c$c$tag.jsonl" \
          > "$R/w1_c$c$tag.log" 2>&1
        echo "c=$c $variant rc=$?"
        grep -E "Output token throughput|eager decode|serial roofline" "$R/w1_c$c$tag.log"
      done
      [ -n "${NO_PROFILE:-}" ] && continue
      mixed=""; [ "$variant" = mixed ] && mixed=--mixed-cuda-graphs
      timeout 90 python3 -m benchmarks.engine.profile_step --preset "$PRESET" --batch 1024 \
        $mixed --engine-args "${engine[$variant]}" --tag "$tag" --out "$R" \
        > "$R/profile_step$tag.log" 2>&1
      echo "profile_step $variant rc=$?"; grep -E "step at batch" "$R/profile_step$tag.log"
    done
    gzip -f "$R"/*.jsonl ;;
  tiles)
    shift
    export MOESERVE_MOE_CONFIG_DIR=$R/moe_configs
    mkdir -p "$MOESERVE_MOE_CONFIG_DIR"
    for p in "$@"; do
      timeout $(( ${BUDGET:-150} + 90 )) python3 -m moeserve.cli generate --preset "$p" \
        --num-prompts 1 --max-tokens 4 --moe-tune-budget-s "${BUDGET:-150}" \
        --json-out "$R/capacity_$p.json" > "$R/tune_$p.log" 2>&1
      echo "$p rc=$?"; grep -E "MoE tune|MoE tile configs" "$R/tune_$p.log"
    done
    ls "$MOESERVE_MOE_CONFIG_DIR" ;;
esac
tar czf "$OUT/issue16.tgz" -C /tmp i16
