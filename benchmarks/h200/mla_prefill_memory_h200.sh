#!/usr/bin/env bash
# Issue 16 (and the memory plan): MLA's up-projected prefill of a long row in context chunks
# (mla/up_projected.py, since ffcac80) on the H200, one call (~5 min): its GPU tests, then
# kernels_mla_prefill --long on glm-4.7-flash (8,192 tokens after 24k / 56k / 190k of context;
# each form's time and peak MiB) with the default chunks and with the context at once
# (--chunk-bytes 1e12), then glm-4.7-flash's start-up capacity report: its profiled activation
# peak and KV tokens (10.98 GiB and 1,151,488 at 70a3760, gpu_70a3760/call3, with the whole
# context up-projected and its [Q, S] mask); and the fresh prompts' varlen experiment
# (MOESERVE_MLA_FRESH_VARLEN=1: kernels_mla_prefill --gluon --fresh-varlen at its default
# cases, W1's mixed step among them: fresh_varlen_ms against absorbed_gluon_ms). Results as
# $OUT/mla_prefill_memory.tgz. W1 with it then: bash benchmarks/h200/w1_repeats_h200.sh DIR
# "default=" "fresh=MOESERVE_MLA_FRESH_VARLEN=1".
#   bash benchmarks/h200/mla_prefill_memory_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/mla_prefill_memory; mkdir -p $R
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla.py tests/kernels/attention/test_mla_decode_gluon_swapped.py \
  > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
for variant in chunks whole; do
  extra=(); [ $variant = whole ] && extra=(--chunk-bytes 1000000000000)
  timeout 150 python3 -m benchmarks.kernels.mla.kernels_mla_prefill --out $R/$variant \
    --presets glm-4.7-flash --long "${extra[@]}" > $R/$variant.log 2>&1
  echo "kernels_mla_prefill $variant rc=$?"
  grep -oE '"case": "[^"]*"|"(mha|absorbed)_(ms|peak_mib)": [0-9.]+' $R/$variant.log | paste -sd' '
done
timeout 150 python3 -m benchmarks.kernels.mla.kernels_mla_prefill --out $R/fresh \
  --presets glm-4.7-flash deepseek-v3 --gluon --fresh-varlen > $R/fresh.log 2>&1
echo "kernels_mla_prefill fresh rc=$?"
grep -oE '"case": "[^"]*"|"(absorbed_gluon|fresh_varlen|mha)_ms": [0-9.]+' $R/fresh.log \
  | paste -sd' '
timeout 150 python3 -m moeserve.cli generate --preset glm-4.7-flash --num-prompts 1 \
  --max-tokens 4 --json-out $R/capacity_glm-4.7-flash.json > $R/capacity.log 2>&1
echo "start-up rc=$?"; grep -E "activation peak|KV cache|start-up" $R/capacity.log
tar czf $OUT/mla_prefill_memory.tgz -C /tmp mla_prefill_memory
