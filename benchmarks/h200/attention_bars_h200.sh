#!/usr/bin/env bash
# Issues 16 and 17's kernel bars in one call (~5 min on the H200): the MLA decode as a served
# step runs it (kernels_mla's "auto": the swapped Gluon kernel to 32 heads, the
# warp-specialized one past 1,024 keys) at 20 / 64 / 128 heads over every case, and DSA's
# decode step at each of its corners (dsa_flush.py), each timed after both of the timer's L2
# flushes (kernel_runs: "read", a served step's clean L2; "zero", do_bench's, which leaves
# dirty lines for the timed kernel to write back: the hard case). -> $OUT/kernels_mla_read.json,
# $OUT/kernels_mla_zero.json, $OUT/dsa_flush.json, and a table printed.
#   bash benchmarks/h200/attention_bars_h200.sh    # HEADS="20 64 128"; WS2=1 adds the
#                                                  # decode_gluon_ws two_pv A/B (~1.5 min)
set -uo pipefail
source benchmarks/gpu_env.sh
for flush in read zero; do
  # shellcheck disable=SC2086
  timeout -s INT ${MLA_TIMEOUT:-110} python3 -m benchmarks.kernels.mla.kernels_mla \
    --out /tmp/bars_$flush --heads ${HEADS:-20 64 128} --l2-flush $flush \
    > "$OUT/kernels_mla_$flush.log" 2>&1
  echo "kernels_mla --l2-flush $flush rc=$?"
  cp /tmp/bars_$flush/kernels_mla.json "$OUT/kernels_mla_$flush.json"
done
timeout -s INT ${DSA_TIMEOUT:-150} python3 -m benchmarks.kernels.mla.dsa_flush --out "$OUT" \
  > "$OUT/dsa_flush.log" 2>&1
echo "dsa_flush rc=$?"
if [ -n "${WS2:-}" ]; then  # the warp-specialized decode with two P V warpgroups (two_pv), an
  # A/B never timed on the H200, beside the served one at 64 and 128 heads (read flush)
  timeout -s INT ${WS2_TIMEOUT:-120} python3 -m benchmarks.kernels.mla.kernels_mla \
    --out /tmp/bars_ws2 --heads 64 128 --forms gluon-ws gluon-ws2 --l2-flush read \
    > "$OUT/kernels_mla_ws2.log" 2>&1
  echo "kernels_mla gluon-ws / gluon-ws2 rc=$?"
  cp /tmp/bars_ws2/kernels_mla.json "$OUT/kernels_mla_ws2.json"
fi
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {f: json.load(open(os.path.join(out, f"kernels_mla_{f}.json")))["cases"]
        for f in ("read", "zero") if os.path.exists(os.path.join(out, f"kernels_mla_{f}.json"))}
zero = {(r["heads"], r["case"]): r for r in runs.get("zero", [])}
for r in runs.get("read", []):
    z = zero.get((r["heads"], r["case"]), {})
    print(f"MLA {r['heads']:>3} heads {r['case']:<14} {r['kernel']:<14} {r['ms']:.4f} ms "
          f"{r['pct_of_bound']}% (zeroed: {z.get('pct_of_bound')}%)")
ws2 = os.path.join(out, "kernels_mla_ws2.json")
for r in json.load(open(ws2))["cases"] if os.path.exists(ws2) else []:
    print(f"MLA {r['heads']:>3} heads {r['case']:<14} {r['form']:<10} {r['ms']} ms "
          f"{r['pct_of_bound']}% (read flush)")
path = os.path.join(out, "dsa_flush.json")
for s in json.load(open(path))["steps"] if os.path.exists(path) else []:
    print(f"DSA {s['case']:<20} {s['step_ms']} ms {s['pct_of_bound']} % of {s['read_bound_ms']} ms;"
          f" alone (read flush): {s.get('parts_ms')} ms")
PY
