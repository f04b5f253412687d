#!/usr/bin/env bash
# Issue 16: the Gluon MLA decode (kernels/attention/mla/decode_gluon.py: wgmma, operands read by
# the tensor cores from shared memory, cp.async loads STAGES - 1 tiles ahead) on the H200 for the
# first time, in one call (~8 minutes; HEADS="20 64" shortens it): its GPU tests, then
# kernels_mla at HEADS (default 20 / 64 / 128),
# the Triton split decode at its defaults beside the Gluon kernel, without and with its overlap,
# at each of GLUON_TILES (BM,BN,W,S: BM and W are 64 and 8; BN keys a tile, S stages: 3 or
# more for the overlap, which skips the others; (64, 64) fits two stages in shared memory); then
# mla_once's A/Bs of DSA's sparse MLA and of the dense decode at W1's context. Results as
# $OUT/mla_gluon.tgz.
#   bash benchmarks/h200/mla_gluon_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
R=/tmp/mla_gluon; mkdir -p $R
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_decode_gluon.py > $R/gpu_tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|Error" $R/gpu_tests.log | tail -8
timeout 120 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/split --heads ${HEADS:-20 64 128} \
  --forms split > $R/kernels_mla_split.log 2>&1
echo "kernels_mla split rc=$?"
timeout 240 python3 -m benchmarks.kernels.mla.kernels_mla --out $R/gluon --heads ${HEADS:-20 64 128} \
  --forms gluon gluon-overlap --tiles ${GLUON_TILES:-64,32,8,3 64,32,8,4 64,16,8,4 64,64,8,2} \
  > $R/kernels_mla_gluon.log 2>&1
echo "kernels_mla gluon rc=$?"; tail -3 $R/kernels_mla_gluon.log
# DSA's sparse MLA (GLM-5's 64 heads, 2,048 selected of 8k / 64k) and the dense decode at
# 20 heads, W1's mean context: Triton against Gluon (mla_once)
once() { timeout 60 python3 -m benchmarks.kernels.mla.mla_once "$@" 2>>$R/once.err | tail -1 \
  | tee -a $R/mla_once.jsonl; }
for args in "--kind sparse --batch 256 --context 8192" "--kind sparse --batch 32 --context 65536" \
            "--kind sparse --batch 128 --context 32768" \
            "--kind dense --heads 20 --batch 1024 --context 192"; do
  once $args
  once $args --gluon
  once $args --gluon --overlap
done
python3 -m benchmarks.kernels.mla.mla_cases_table $R/split/kernels_mla.json $R/gluon/kernels_mla.json
tar czf $OUT/mla_gluon.tgz -C /tmp mla_gluon
