#!/usr/bin/env bash
# The warp-specialized Gluon MLA decode (mla/decode_gluon_ws.py) in one call (~5 min): its GPU
# tests, then kernels_mla at 64 and 128 heads (GLM-5's, DeepSeek-V3's) with decode_gluon's
# kernel and with it (its copies by either warpgroup), each case's share of max(read, compute)
# bound side by side. A kernels_mla run a form, so that a failed check of the new kernel keeps
# the others' figures.
# Into DIR (default $OUT/mla_ws).
#   bash benchmarks/h200/mla_ws_h200.sh [DIR]
set -uo pipefail
source benchmarks/gpu_env.sh
dir=${1:-$OUT/mla_ws}
mkdir -p "$dir/gluon" "$dir/gluon-ws" "$dir/gluon-ws-wl"
timeout 150 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider \
  tests/kernels/attention/test_mla_decode_gluon_ws.py > "$dir/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$dir/gpu_tests.log"
for form in gluon-ws gluon-ws-wl gluon; do
  timeout -s INT 150 python3 -m benchmarks.kernels.kernels_mla --out "$dir/$form" \
    --heads 64 128 --forms "$form" > "$dir/$form/kernels_mla.log" 2>&1
  echo "kernels_mla $form rc=$?"
done
python3 - "$dir" <<'PY'
import json, sys
rows = {}
for form in ("gluon", "gluon-ws", "gluon-ws-wl"):
    try:
        data = json.load(open(f"{sys.argv[1]}/{form}/kernels_mla.json"))
    except (OSError, ValueError) as e:
        print(form, "no results:", e)
        continue
    for r in data["cases"]:
        rows.setdefault((r["heads"], r["case"]), {})[form] = (r["ms"], r["pct_of_bound"])
for (heads, case), got in sorted(rows.items()):
    print(heads, case, got)
PY
