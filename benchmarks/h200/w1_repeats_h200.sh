#!/usr/bin/env bash
# W1 through the server, variants alternated RUNS times at each concurrency, with each variant's
# median output tok/s and share of the serial roofline at the end (one run moves by about a
# point between sessions: a lever worth under that wants medians). Each run is gpu_env.sh's
# w1_run (a server the bench starts; W1_TIMEOUT seconds, default 110), into DIR/<variant>_c<C>_r<i>.
#   PRESET=glm-4.7-flash CONC="512 1024" RUNS=3 bash benchmarks/h200/w1_repeats_h200.sh DIR \
#       "default=" "fold=-- --fold-shared-experts" "unswapped=MOESERVE_MLA_DECODE_SWAPPED=0"
# A variant is NAME=ARGS, ARGS as w1_run takes them: VAR=VALUE ... [-- serve flags ...].
# About 60-100 s a run at 256-1,024 streams: keep RUNS x concurrencies x variants within a call.
# Give DIR outside $OUT (e.g. /tmp/w1r): it comes back as $OUT/<DIR name>.tgz.
set -uo pipefail
source benchmarks/gpu_env.sh
dir=${1:?usage: w1_repeats_h200.sh DIR NAME=ARGS ...}
shift
[ $# -ge 1 ] || { echo "no variants given"; exit 2; }
mkdir -p "$dir"
# the device tool brings back only a few files a call (gpu_7c427c9/call4 lost four logs): DIR
# as one archive in $OUT when DIR is outside it, renewed after each run (a call cut by its
# limit still brings back the runs done)
pack() {
  if [ -n "${OUT:-}" ] && [[ "$(realpath "$dir")" != "$(realpath "$OUT")"* ]]; then
    tar czf "$OUT/$(basename "$dir").tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
  fi
}
for c in ${CONC:-512 1024}; do
  for i in $(seq 1 "${RUNS:-3}"); do
    for spec in "$@"; do
      name=${spec%%=*}; args=${spec#*=}
      # shellcheck disable=SC2086  # ARGS is word-split on purpose
      w1_run "${PRESET:-glm-4.7-flash}" "$c" "${name}_c${c}_r$i" "$dir" $args
      pack
    done
  done
done
gzip -f "$dir"/*.jsonl 2>/dev/null
python3 - "$dir" "$@" <<'EOF'
import pathlib, re, statistics, sys

root, names = pathlib.Path(sys.argv[1]), [s.split("=", 1)[0] for s in sys.argv[2:]]
runs: dict = {}
for log in sorted(root.glob("*_c*_r*.log")):
    name, c = re.match(r"(.+)_c(\d+)_r\d+$", log.stem).groups()
    text = log.read_text()
    tok = re.search(r"Output token throughput \(tok/s\)\s*│\s*([\d.]+)", text)
    share = re.search(r"this run ([\d.]+)% of it", text)
    if tok and share:
        runs.setdefault((int(c), name), []).append((float(tok[1]), float(share[1])))
for (c, name), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], names.index(kv[0][1]))):
    print(f"c{c} {name}: median {statistics.median(t for t, _ in rs):,.0f} tok/s "
          f"({statistics.median(s for _, s in rs):.1f}%), runs {[t for t, _ in rs]}")
EOF
pack
