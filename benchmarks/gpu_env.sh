# Sourced by the GPU-machine scripts: the wheels brought in .whl/ (benchmarks/gpu_wheels.sh
# fills it here) installed once into /tmp/site (and the modules the runs import checked)
# and on PYTHONPATH with the checkout, the commit under test (GIT_COMMIT, written before the
# call) exported for the results' provenance, and the device and versions written to $OUT.
#   [GPU_ENV_VERSIONS="optuna ..."] source benchmarks/gpu_env.sh
# (modules whose versions go beside torch's and Triton's; not positional arguments: `source`
# without arguments hands the sourcing script's own, e.g. mla_h200.sh's "decode", to this file)
export SITE=/tmp/site  # exported: the scripts run the benchmarks in subshells
# (re)installed when the set of wheels differs from the one installed (a warm machine keeps
# /tmp/site between calls)
WHEELS=$(ls .whl | sort | md5sum | cut -c1-32)
if [ "$(cat "$SITE/.wheels" 2>/dev/null)" != "$WHEELS" ]; then
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" .whl/*.whl && echo "$WHEELS" > "$SITE/.wheels"
fi
export PYTHONPATH=$PWD:$SITE
# what the server, the bench, the tuner and the tests import from those wheels: name what is
# missing now rather than in a failed server's log (a checkout without .whl/, or a wheel the
# list in benchmarks/gpu_wheels.sh lacks)
python3 -c "
import importlib.util, sys
need = ('fastapi', 'uvicorn', 'zmq', 'msgspec', 'orjson', 'openai', 'optuna',
        'compressed_tensors', 'xdist', 'opentelemetry', 'llguidance')
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit('gpu_env.sh: not importable here: ' + ', '.join(missing)
             + ' (run bash benchmarks/gpu_wheels.sh before the call and carry .whl)')
" || echo "gpu_env.sh: WARNING: the runs below that need those modules will fail" >&2
[ -f GIT_COMMIT ] && export MOESERVE_GIT_COMMIT=$(cat GIT_COMMIT)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > "$OUT/device.csv" 2>&1
python3 -c "import sys, torch, triton; extra = [__import__(m) for m in sys.argv[1:]]; \
print(torch.__version__, triton.__version__, *(m.__version__ for m in extra))" \
  ${GPU_ENV_VERSIONS:-} \
  > "$OUT/versions.txt" 2>&1

# run_gpu_tests SECONDS [K/N]: `pytest -m gpu` over the test tree into $OUT/gpu_tests.log; with
# K/N only the K-th of N parts of its files (balanced by their GPU tests' count): the whole
# tree takes more than one call's 600 s on the H200 (gpu_e6ddc73/call2: ~58% in 500 s), so
# "1/2" and "2/2" in two calls. If the run crashes (a device-side assert aborts the whole
# process, and every later test errors), each test file then runs in a process of its own
# within what is left of SECONDS, their logs in $OUT/gpu_tests_by_file.tgz (a call returns at
# most 8 files), so one call shows them all. GPU_TEST_WORKERS=W (default 1): the kernel tests
# (tests/kernels/) in W pytest-xdist processes, a file each at a time (their time is mostly
# Triton's compiles, on the CPU), before the rest in one process (the engine tests each take
# 90% of the GPU's memory); not yet tried on a GPU machine.
gpu_test_part() {  # K/N -> the K-th part's test files, one a line
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider tests 2>/dev/null \
    | grep "::" | sed 's/::.*//' | python3 -c "
import collections, sys
k, n = map(int, sys.argv[1].split('/'))
counts = collections.Counter(line.strip() for line in sys.stdin)
parts = [[0, []] for _ in range(n)]
for path, c in sorted(counts.items(), key=lambda pc: (-pc[1], pc[0])):
    lightest = min(parts, key=lambda p: p[0])
    lightest[0] += c
    lightest[1].append(path)
print('\n'.join(sorted(parts[k - 1][1])))" "$1"
}
run_gpu_tests() {
  local start=$SECONDS rc targets=(tests) workers=${GPU_TEST_WORKERS:-1}
  # SIGINT at the limit: pytest then still prints its failures and the slowest tests
  local stop=(timeout -s INT -k 30)
  local pytest=(python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --durations=25)
  # shellcheck disable=SC2207
  [ -n "${2:-}" ] && targets=($(gpu_test_part "$2"))
  if [ "$workers" -gt 1 ]; then
    local kernels=() rest=() f
    for f in "${targets[@]}"; do
      case "$f" in
        tests) kernels+=(tests/kernels); rest+=(tests --ignore=tests/kernels) ;;
        tests/kernels/*) kernels+=("$f") ;;
        *) rest+=("$f") ;;
      esac
    done
    rc=0
    if [ "${#kernels[@]}" -gt 0 ]; then
      "${stop[@]}" "$1" "${pytest[@]}" -n "$workers" --dist loadfile "${kernels[@]}" \
        > "$OUT/gpu_tests.log" 2>&1
      rc=$?
      echo "kernel tests in $workers processes: $(tail -1 "$OUT/gpu_tests.log") \
($((SECONDS - start)) s)"
    fi
    local left=$(( $1 - (SECONDS - start) )) rc2
    if [ "${#rest[@]}" -gt 0 ] && [ "$rc" -le 128 ] && [ "$left" -gt 20 ]; then
      "${stop[@]}" "$left" "${pytest[@]}" "${rest[@]}" >> "$OUT/gpu_tests.log" 2>&1
      rc2=$?
      [ "$rc2" -gt "$rc" ] && rc=$rc2
    fi
  else
    "${stop[@]}" "$1" "${pytest[@]}" "${targets[@]}" > "$OUT/gpu_tests.log" 2>&1
    rc=$?
  fi
  tail -3 "$OUT/gpu_tests.log"
  if [ "$rc" -gt 128 ]; then
    echo "pytest crashed (rc $rc): file by file"
    local dir=/tmp/gpu_tests_by_file f
    mkdir -p "$dir"
    for f in $(python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "${targets[@]}" \
               2>/dev/null | grep "::" | sed 's/::.*//' | sort -u); do
      local left=$(( $1 - (SECONDS - start) ))
      [ "$left" -gt 20 ] || break
      timeout "$left" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider "$f" \
        > "$dir/$(basename "$f" .py).log" 2>&1
      echo "$f: $(tail -1 "$dir/$(basename "$f" .py).log")"
    done
    tar czf "$OUT/gpu_tests_by_file.tgz" -C /tmp gpu_tests_by_file
  fi
  return "$rc"
}

# w1_run PRESET CONCURRENCY NAME DIR [VAR=VALUE ...] [-- SERVER FLAGS ...]: W1 (the bench's
# defaults) through a server the bench starts, with those environment variables and `moeserve
# serve` flags, into DIR/NAME.log and DIR/NAME.jsonl (W1_TIMEOUT seconds, default 110); prints
# its exit status and headline lines. An A/B of two runs in a row is biased: on an H100 the
# second of a pair was ~3% faster whichever ran second (gpu_43c198d), so run A B B A.
w1_run() {
  local preset=$1 c=$2 name=$3 dir=$4 server="" rc extra=()
  shift 4
  # W1_EXTRA_BODY: a JSON object added to every request (moeserve bench --extra-body)
  [ -n "${W1_EXTRA_BODY:-}" ] && extra=(--extra-body "$W1_EXTRA_BODY")
  local vars=()
  while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; server="$*"; break; fi
    vars+=("$1"); shift
  done
  timeout "${W1_TIMEOUT:-110}" env "${vars[@]}" python3 -m moeserve.cli bench --preset "$preset" \
    --max-concurrency "$c" --server-args="$server" --no-progress "${extra[@]}" \
    --output-json "$dir/$name.jsonl" > "$dir/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc"
  grep -E "Output token throughput|eager decode|serial roofline|Median TTFT|Median TPOT" \
    "$dir/$name.log"
}

# dsa_decode_run NAME DIR [VAR=VALUE ...]: kernels_dsa --decode-only (DSA's decode step at
# GLM-5's shape, the sparse MLA alone and the step in a CUDA graph) with those environment
# variables, into DIR/NAME/ (DSA_TIMEOUT seconds, default 120); prints its exit status and a
# line a case.
dsa_decode_run() {
  local name=$1 dir=$2
  shift 2
  mkdir -p "$dir/$name"
  timeout -s INT "${DSA_TIMEOUT:-120}" env "$@" python3 -m benchmarks.kernels.mla.kernels_dsa \
    --out "$dir/$name" --decode-only > "$dir/$name/kernels_dsa.log" 2>&1
  echo "kernels_dsa $name rc=$?"
  python3 -c "
import json
for r in json.load(open('$dir/$name/kernels_dsa.json'))['decode']:
    print('$name', r['case'], 'sparse', r['sparse_mla_ms'], 'gluon slots',
          r.get('sparse_mla_gluon_slots_ms'), 'step graph', r['dsa_graph_ms'],
          r['pct_of_bound_graph'])"
}

# ncu_profile DIR NAME LIMIT PATTERN NCU_ARGS... -- CMD...: Nsight Compute (NCU, default ncu
# on the path) over CMD, its profiled range only (`--profile-from-start off`), into
# DIR/NAME.ncu-rep, the details page as DIR/NAME.txt, its lines matching the egrep PATTERN
# printed (30 at most); LIMIT seconds for the run. With NCU_ALL=1 also DIR/NAME_all.txt, the
# sections' bodies too (--print-details all: warp stall reasons, pipe utilizations).
ncu_profile() {
  local dir=$1 name=$2 limit=$3 pattern=$4 ncu=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
  shift 4
  local args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
  shift
  timeout "$limit" "$ncu" --profile-from-start off --target-processes all "${args[@]}" \
    -o "$dir/$name" -f "$@" > "$dir/$name.log" 2>&1
  echo "$name: ncu rc=$?"
  if [ -f "$dir/$name.ncu-rep" ]; then
    "$ncu" --import "$dir/$name.ncu-rep" --page details > "$dir/$name.txt" 2>&1
    [ "${NCU_ALL:-0}" = 1 ] && "$ncu" --import "$dir/$name.ncu-rep" --page details \
      --print-details all > "$dir/${name}_all.txt" 2>&1
    grep -E "$pattern" "$dir/$name.txt" | head -30
  fi
}
