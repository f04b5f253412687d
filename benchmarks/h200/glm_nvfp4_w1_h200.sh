#!/usr/bin/env bash
# Issue 18's two GLM W1 runs in NVFP4, now that both expert shapes have committed H200 tiles
# (gpu_4705423/call3-4), so no server tunes at start-up. One call a part (~6-8 minutes each):
#   flash  glm-4.7-flash at 1,024 streams, bf16 then NVFP4 (the issue: "On glm-4.7-flash at
#          1,024 in NVFP4 against its bf16 run")
#   glm5   the seeds' model in the seeds' format on one GPU: glm-5 sliced to LAYERS (default 20:
#          3 dense + 17 MoE layers, about 100 GB of NVFP4 weights by the roofline's count,
#          5.6 GB a MoE layer; LAYERS=12 on an H100's 80 GB) at 1,024 streams, beside its
#          serial roofline; FORMATS="nvfp4 nvfp4rows": micro-tiled experts against rows
# Each part is quant_w1_h200.sh (the run JSONs, logs and compare.json) into /tmp/qw1_<part>,
# returned as $OUT/qw1_<part>.tgz.
#   bash benchmarks/h200/glm_nvfp4_w1_h200.sh flash
#   LAYERS=20 bash benchmarks/h200/glm_nvfp4_w1_h200.sh glm5
set -uo pipefail
source benchmarks/gpu_env.sh
part=${1:?usage: glm_nvfp4_w1_h200.sh flash|glm5}
dir=/tmp/qw1_$part
case $part in
  flash)
    PRESET=glm-4.7-flash FORMATS="bf16 nvfp4" CONCS=1024 BUDGET_S=${BUDGET_S:-540} \
      bash benchmarks/h200/quant_w1_h200.sh "$dir" ;;
  glm5)
    PRESET=glm-5 FORMATS=${FORMATS:-nvfp4} CONCS=1024 BUDGET_S=${BUDGET_S:-560} \
      SERVER_ARGS="--hf-overrides '{\"num_hidden_layers\": ${LAYERS:-20}}' --max-model-len 4096" \
      bash benchmarks/h200/quant_w1_h200.sh "$dir" ;;
  *) echo "unknown part $part (flash | glm5)"; exit 2 ;;
esac
tar czf "$OUT/qw1_$part.tgz" -C /tmp "qw1_$part"
