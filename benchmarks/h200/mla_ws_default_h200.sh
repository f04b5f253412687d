#!/usr/bin/env bash
# decode_gluon_ws made the default from 1,024 keys (session 36): its GPU tests, decode_gluon's
# (routing, capacity report) and the structured OOM test fixed (~2 min).
#   bash benchmarks/h200/mla_ws_default_h200.sh
set -uo pipefail
source benchmarks/gpu_env.sh
timeout 200 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/attention/test_mla_decode_gluon_ws.py tests/kernels/attention/test_mla_decode_gluon.py "tests/engine/test_structured_outputs.py::test_a_deferred_sampling_out_of_memory_loses_nothing" > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -3 $OUT/gpu_tests.log
