#!/usr/bin/env bash
# Issue 16: glm-4.7-flash's start-up and decode step after session 29's two unmeasured changes,
# one call (~5 min): the memory plan's profile under mla/up_projected.memory_probe (one prefix
# chunk of each size; the warm start-up was 31.7 s with 12.4 s of profile, the issue asks 30)
# and the shared experts' add in their down GEMM's epilogue (the decode step at 1,024 rows had
# 0.40 ms of `add_` in 46 launches). GPU tests of the probe (its peak equal to the whole row's)
# and the bf16 agreement; benchmarks.engine.startup cold then warm (the activation peak in the
# report, 6.89 GiB before); profile_step at 1,024 rows; kernels_mla_prefill's fresh-prompt
# cases, now with decode rows beside 512+-token prompts. Results as $OUT/startup_profile.tgz.
# W1 after it: CONC=1024 RUNS=2 bash benchmarks/h200/w1_repeats_h200.sh DIR "default=".
#   bash benchmarks/h200/startup_profile_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/startup_profile; mkdir -p $R
timeout 120 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla.py tests/engine/test_gpu_bf16_agreement.py \
  > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -2 $R/gpu_tests.log
timeout 200 python3 -m benchmarks.engine.startup --preset glm-4.7-flash --runs 2 --fresh-cache \
  --out $R > $R/startup.log 2>&1
echo "startup rc=$?"; grep -E "^(cold|warm):" $R/startup.log
python3 -c "
import json
for r in json.load(open('$R/startup_glm-4.7-flash.json'))['runs'][:1]:
    m = r['capacity_report']['memory']
    print(f\"activation peak {m['activation_peak_bytes'] / 2**30:.2f} GiB, \"
          f\"{m['num_kv_tokens']:,} KV tokens\")"
timeout 200 python3 -m benchmarks.engine.profile_step --preset glm-4.7-flash --batch 1024 \
  --out $R > $R/profile.log 2>&1
echo "profile rc=$?"; grep -E "^(decode|mixed) step" $R/profile.log
# fresh prompts of 512+ tokens beside decode rows (the default splits such a step; only
# fresh-only steps and W1's were timed)
timeout 120 python3 -m benchmarks.kernels.mla.kernels_mla_prefill --out $R/fresh \
  --presets glm-4.7-flash deepseek-v3 --gluon --fresh-varlen > $R/fresh.log 2>&1
echo "kernels_mla_prefill fresh rc=$?"
grep -oE '"case": "[^"]*"|"(absorbed_gluon|fresh_varlen)_ms": [0-9.]+' $R/fresh.log | paste -sd' '
tar czf $OUT/startup_profile.tgz -C /tmp startup_profile
