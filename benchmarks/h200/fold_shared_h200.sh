#!/usr/bin/env bash
# Issue 16, item 2: shared experts at no extra launch cost (`--fold-shared-experts`: the shared
# MLP's weights appended to the routed stack as always-selected experts), measured on the H200
# for glm-4.7-flash (64 routed + 1 shared expert of width 1,536: E = 65 when folded). Two modes,
# one call each; results under $OUT.
#   bash benchmarks/h200/fold_shared_h200.sh tune  # (~5 min) the folded shape's tiles (E=65),
#        # tuned by one engine start: commit $OUT/moe_configs/*.json under
#        # moeserve/kernels/moe/configs/ before the w1 mode
#   bash benchmarks/h200/fold_shared_h200.sh w1    # (~9 min) W1 at CONC (default 256 512
#        # 1024) through the server, the defaults and --fold-shared-experts in turn at each
#        # concurrency, committed tiles for both (a missing file would be tuned at start-up
#        # and the run would time out: the log says so)
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/fold_shared; mkdir -p $R
case "${1:-w1}" in
  tune)
    bash benchmarks/h200/moe_tiles_h200.sh glm-4.7-flash 240 --fold-shared-experts \
      > $R/tune.log 2>&1
    echo "tune rc=$?"; tail -5 $R/tune.log
    python3 -c "
import json
r = json.load(open('$OUT/capacity_glm-4.7-flash.json'))['capacity']
print(r.get('shared_experts'), r.get('moe_tune'))" ;;
  w1)
    for c in ${CONC:-256 512 1024}; do
      w1_run glm-4.7-flash "$c" "w1_c${c}_default" $R
      w1_run glm-4.7-flash "$c" "w1_c${c}_fold" $R -- --fold-shared-experts
    done
    gzip -f $R/*.jsonl ;;
esac
tar czf $OUT/fold_shared.tgz -C /tmp fold_shared
