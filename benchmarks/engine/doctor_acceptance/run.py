"""Issue #5's acceptance on the GPU machine: the doctor names the cap, and diagnostics' cost.

(a) The seeds' first finding, on purpose. W1 (random prompts of 128 tokens, exactly 128 output
    tokens, ignore_eos) at client concurrency 1,024 against `moeserve serve --max-running-requests
    64`, then against the automatic cap, both with `--diagnose`. Both result lines are saved
    (OUT/w1_<preset>_c<C>_cap<cap>.jsonl and OUT/w1_<preset>_c<C>_auto.jsonl), `moeserve report`
    writes OUT/report/ (markdown + PNGs), `moeserve doctor` prints both runs' verdicts
    (OUT/doctor.txt), and the summary records whether the doctor's `admission_cap` verdict is in
    the first run and absent from the second.

(b) What diagnostics cost at concurrency 1,024: the median output throughput of `--repeats` (3)
    runs with diagnostics on against as many with them off, with the spread, into
    OUT/diagnostics_overhead.json. Overhead = 1 - median_on / median_off (the target is <= 2%).

    Diagnostics are not only the client's `--diagnose` (the /v1/engine, NVML and process-CPU
    samplers): the engine also counts tokens per expert on the device (`collect_expert_load`)
    and times every 32nd step with CUDA events (`step_profile_every`). Both are on by default
    and are engine flags, fixed for a server's life. So the honest comparison, the default
    design `two-servers`, is
        on  = a server with the defaults (collection on)          + `moeserve bench --diagnose`
        off = a server with `--no-collect-expert-load --step-profile-every 0` + no `--diagnose`
    Each server starts once (a start costs 30-60 s on the H200, so a restart per run does not fit
    the budget); its runs follow one another, so the groups are blocked (on, on, on on one server,
    then off, off, off on the other), not interleaved. Every run warms up first (the bench's
    warm-up request and 1 s of quiet) and the first run of each server is a run of its group, so
    both groups hold one "first run after start"; the median of each group drops one outlier.
    The (a) auto run is exactly an "on" run (same server, flags and prompt count), so it is the
    first "on" run and is not repeated.
    Other designs (`--overhead-design`):
        one-server  one server with collection on; the client alternates --diagnose on / off
                    (interleaved: on, off, on, off, ...). Measures the client-side samplers and
                    the /v1/engine polling only: the engine's counters run in both groups.
        restarts    a fresh server for every run, alternating on / off servers: interleaved and
                    the full cost, but 2 x repeats server starts (does not fit 8 minutes at
                    the defaults on the H200).
    Every run uses its own seed: no prompt repeats, so the prefix cache never helps a later run.

One server per configuration (cap, on, off), each started once and reused for its runs (the bench
runs in this process against it, as `moeserve bench` does after starting a server itself, so
`--diagnose` also samples the server's processes). The order is cap run, auto run (= on #1), the
report and the doctor (so (a) is complete early), then the rest of (b). Before each server start
and run the time left before `--deadline-s` is checked against an estimate; what does not fit is
skipped and said so. summary.json (and diagnostics_overhead.json) are rewritten after every step,
and `--bundle FILE` rewrites a tar.gz of OUT after every step, so a run killed at its time limit
still leaves its data.

Budget on one H200 (defaults; the engine ~10-25k output tok/s at c1024, 3-6k at cap 64):
    3 server starts x 30-60 s                                         1.5-3 min
    cap 64:   1,024 prompts x 128 tokens at 3-6k tok/s + warm-up       25-45 s
    auto/on:  3 x 2,048 prompts x 128 tokens at 10-25k tok/s           35-80 s
    off:      3 x the same                                             35-80 s
    report + doctor + server stops                                     20-40 s
    total                                                              ~4-7 min

Usage (GPU; OUT may hold at most 8 files on the device machine, hence --bundle):
    python -m benchmarks.engine.doctor_acceptance --out /tmp/doctor_acceptance \
        --bundle $OUT/doctor_acceptance.tar.gz
CPU smoke test (tiny-moe, a minute or so):
    python -m benchmarks.engine.doctor_acceptance --preset tiny-moe --server-args "--device cpu" \
        --concurrency 8 --cap 2 --num-prompts 32 --input-len 32 --output-len 32 --out /tmp/acc

The script's parts: plan.py (the pure helpers: the plan, the statistics, the cap
check, the arguments), state.py (the run's record and its files), host.py
(the environment, the server subprocess); this module runs the steps.

Outputs under --out:
    summary.json                  steps, timings, environment, the cap check, the overhead
    diagnostics_overhead.json     (b)
    w1_<preset>_c<C>_cap<cap>.jsonl, w1_<preset>_c<C>_auto.jsonl   the (a) runs (one JSON line
                                  each, as `moeserve bench --output-json` writes, per-chunk
                                  arrival times dropped as in benchmarks/engine/split_runs.py, plus
                                  "environment" and "acceptance"); `moeserve report` and
                                  `moeserve doctor` read them
    overhead/*.jsonl              the other (b) runs
    report/                       report.md + PNGs;   doctor.txt, doctor.jsonl
    logs/                         each server's log
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.engine.doctor_acceptance.host import (
    Server,
    environment,
    gpu_memory_used,
    wait_gpu_memory_back,
)
from benchmarks.engine.doctor_acceptance.plan import (
    CAP_RULE,
    DESIGNS,
    Step,
    bench_argv,
    cap_check,
    plan_steps,
    server_args,
    slim_result,
    verdict_rules,
)
from benchmarks.engine.doctor_acceptance.state import (
    T0,
    State,
    log,
    run_record,
    save_state,
)

# first guesses for the deadline check, replaced by what is measured (H200, qwen3-30b-a3b)
DEFAULT_START_S = 90.0
DEFAULT_TPUT = {"cap": 2500.0, "auto": 8000.0}
RUN_SLACK_S = 10.0  # warm-up, workload, the bench's table and the doctor
REPORT_EST_S = 30.0

# ---- the script ---------------------------------------------------------------------------

class Heartbeat:
    """A line every `every_s` while a long step runs (a hung step shows in the log)."""

    def __init__(self, what: str, every_s: float = 30.0) -> None:
        self.what, self.every_s = what, every_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t = time.monotonic()
        while not self._stop.wait(self.every_s):
            log(f"... {self.what}: {time.monotonic() - t:.0f} s")

    def __enter__(self) -> Heartbeat:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def bench_once(step: Step, server: Server, args: argparse.Namespace, seed: int,
               raw: Path) -> dict[str, Any]:
    """One timed run through the bench (in this process, against `server`); its JSON object."""
    from rich.console import Console

    from moeserve.bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="moeserve bench")
    bench_cli.add_bench_args(parser)
    ns = parser.parse_args(bench_argv(step, args, seed, raw))
    raw.unlink(missing_ok=True)
    console = Console(width=120)
    assert server.proc is not None
    rc = bench_cli._bench(ns, server.url, console, started=True,
                          server_proc=(server.proc.pid, server.port))
    if not raw.is_file():
        raise RuntimeError(f"the bench wrote no result (exit code {rc})")
    lines = [ln for ln in raw.read_text().splitlines() if ln.strip()]
    raw.unlink()
    return json.loads(lines[-1])


def moeserve_cli(argv: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *argv], capture_output=True,
                          text=True, timeout=timeout_s)


def do_report(st: State) -> None:
    """`moeserve report` and `moeserve doctor` on the (a) runs; the cap check."""
    cap_step = next(s for s in st.steps if "cap" in s.roles)
    auto_step = next(s for s in st.steps if "auto" in s.roles)
    if cap_step.name not in st.results or auto_step.name not in st.results:
        raise RuntimeError("the cap or the auto run is missing: no report")
    files = [str(st.out / cap_step.file), str(st.out / auto_step.file)]
    rep_dir = st.out / "report"
    p = moeserve_cli(["report", *files, "--out", str(rep_dir)])
    print(p.stdout + p.stderr, end="", flush=True)
    pngs = sorted(rep_dir.glob("*.png"))
    st.report = {"cmd": f"moeserve report {' '.join(files)} --out {rep_dir}",
                 "returncode": p.returncode,
                 "markdown": str(rep_dir / "report.md") if (rep_dir / "report.md").is_file()
                 else None,
                 "pngs": {f.name: f.stat().st_size for f in pngs},
                 "pngs_nonempty": bool(pngs) and all(f.stat().st_size > 0 for f in pngs)}
    text = moeserve_cli(["doctor", *files])
    (st.out / "doctor.txt").write_text(text.stdout + text.stderr)
    log("moeserve doctor on the (a) runs:")
    print(text.stdout + text.stderr, end="", flush=True)
    js = moeserve_cli(["doctor", "--json", *files])
    (st.out / "doctor.jsonl").write_text(js.stdout)
    lines = [json.loads(ln) for ln in js.stdout.splitlines() if ln.strip()]
    if js.returncode != 0 or len(lines) != 2:
        raise RuntimeError(f"moeserve doctor --json: exit {js.returncode}, {len(lines)} lines; "
                           f"{js.stderr.strip()}")
    cli_cap, cli_auto = (verdict_rules(ln.get("verdicts")) for ln in lines)
    bench_cap = verdict_rules(st.results[cap_step.name].get("verdicts"))
    bench_auto = verdict_rules(st.results[auto_step.name].get("verdicts"))
    check = cap_check(cli_cap, cli_auto)
    cap_verdict = next((v for v in lines[0].get("verdicts") or []
                        if v.get("rule") == CAP_RULE), None)
    check.update({"cap_run": files[0], "auto_run": files[1],
                  "cap_run_rules": cli_cap, "auto_run_rules": cli_auto,
                  "bench_doctor_agrees": (bench_cap, bench_auto) == (cli_cap, cli_auto),
                  "cap_verdict": cap_verdict,
                  "engine_max_running_requests": [
                      _find(st.results[n].get("engine"), "max_running_requests")
                      for n in (cap_step.name, auto_step.name)]})
    st.cap = check
    log(f"cap check: admission_cap in the cap-{st.args.cap} run: {check['named_in_cap_run']}; "
        f"in the auto run: {check['named_in_auto_run']} -> "
        f"{'PASS' if check['pass'] else 'FAIL'}")


def _find(doc: Any, key: str) -> Any:
    from moeserve.bench.server import find_key

    return find_key(doc, key)


def estimate_s(step: Step, st: State, need_start: bool) -> float:
    a = st.args
    if step.kind == "report":
        return REPORT_EST_S
    starts = [s["start_s"] for s in st.servers if s.get("start_s")]
    est = (max(starts) if starts else DEFAULT_START_S) + 10.0 if need_start else 0.0
    kind = "cap" if step.server == "cap" else "auto"
    seen = [st.results[s.name].get("output_throughput") for s in st.steps
            if s.name in st.results and ("cap" if s.server == "cap" else "auto") == kind]
    seen = [x for x in seen if x]
    tput = min(seen) if seen else DEFAULT_TPUT[kind]
    return est + step.num_prompts * a.output_len / tput + RUN_SLACK_S


def execute(st: State) -> None:
    a = st.args
    baseline = gpu_memory_used()
    server: Server | None = None
    n_starts: dict[str, int] = {}
    try:
        for idx, step in enumerate(st.steps):
            rec: dict[str, Any] = {"name": step.name, "kind": step.kind, "server": step.server,
                                   "diagnose": step.diagnose, "roles": list(step.roles),
                                   "num_prompts": step.num_prompts, "file": step.file or None}
            st.records.append(rec)
            need_start = step.kind == "run" and (server is None or server.key != step.server)
            est = estimate_s(step, st, need_start)
            left = a.deadline_s - (time.monotonic() - T0)
            # the first step always runs (nothing to save yet), and so does the report: (a)'s
            # runs are done by then and it takes seconds
            if est > left and idx > 0 and step.kind != "report":
                for s in st.steps[idx:]:
                    if s is not step:
                        st.records.append({"name": s.name, "kind": s.kind, "status": "skipped",
                                           "why": "deadline (an earlier step did not fit)"})
                rec.update(status="skipped", why=f"deadline: needs ~{est:.0f} s, {left:.0f} s "
                                                 f"left of --deadline-s {a.deadline_s:.0f}")
                log(f"SKIP {step.name} and the rest: {rec['why']}")
                break
            t = time.monotonic()
            rec["started_s"] = round(t - T0, 1)
            try:
                if step.kind == "report":
                    log("report + doctor on the (a) runs")
                    do_report(st)
                else:
                    if need_start:
                        if server is not None:
                            log(f"stopping the {server.key} server")
                            server.stop()
                            wait_gpu_memory_back(baseline)
                        n_starts[step.server] = n_starts.get(step.server, 0) + 1
                        sargs = server_args(step.server, a)
                        logp = st.out / "logs" / f"server_{step.server}_{n_starts[step.server]}.log"
                        server = Server(step.server, a.preset, sargs, a.port, logp,
                                        a.server_timeout)
                        log(f"starting the {step.server} server: {shlex.join(server.cmd[3:])}")
                        srec: dict[str, Any] = {"key": step.server, "args": sargs,
                                                "log": str(logp), "started_s": rec["started_s"]}
                        st.servers.append(srec)
                        with Heartbeat(f"{step.server} server start"):
                            server.start()
                        srec["start_s"] = round(server.start_s or 0.0, 1)
                        log(f"{step.server} server ready in {server.start_s:.1f} s at "
                            f"{server.url}")
                    assert server is not None
                    seed = a.seed + idx
                    log(f"run {step.name}: {step.num_prompts} prompts, concurrency "
                        f"{a.concurrency}, {'--diagnose' if step.diagnose else 'no --diagnose'}, "
                        f"{step.server} server, seed {seed}")
                    raw = st.out / f".{step.name}.raw.jsonl"
                    t_run = time.monotonic()
                    with Heartbeat(step.name):
                        res = bench_once(step, server, a, seed, raw)
                    res = slim_result(res)
                    res["environment"] = st.env
                    res["acceptance"] = {"issue": 5, "step": step.name, "roles": list(step.roles),
                                         "server": step.server,
                                         "server_args": server_args(step.server, a),
                                         "diagnose": step.diagnose,
                                         "overhead_design": a.overhead_design, "seed": seed}
                    path = st.out / step.file
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(res) + "\n")
                    st.results[step.name] = res
                    rec.update(run_record(res), run_s=round(time.monotonic() - t_run, 1))
                    log(f"done {step.name}: {res['output_throughput']:,.0f} output tok/s, "
                        f"{res['completed']} completed, {res['failed']} failed, "
                        f"{res['duration']:.1f} s; verdicts {rec['verdicts'] or 'none'}")
                rec["status"] = "ok"
            except Exception as e:  # one step's failure must not cost the others' data
                rec.update(status="failed", error=f"{type(e).__name__}: {e}")
                log(f"FAILED {step.name}: {type(e).__name__}: {e}")
                if step.kind == "run" and server is not None and server.proc is not None \
                        and server.proc.poll() is not None:
                    server = None  # dead: the next run starts a fresh one
            rec["seconds"] = round(time.monotonic() - t, 1)
            save_state(st)
    finally:
        if server is not None:
            log(f"stopping the {server.key} server")
            server.stop()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/doctor_acceptance",
                   help="folder for everything (created)")
    p.add_argument("--bundle", help="also keep a tar.gz of --out here, rewritten after each step")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--concurrency", type=int, default=1024, help="client concurrency (W1: 1024)")
    p.add_argument("--cap", type=int, default=64, help="--max-running-requests of the (a) run")
    p.add_argument("--num-prompts", type=int,
                   help="prompts of every run (sets the three below unless they are given)")
    p.add_argument("--num-prompts-cap", type=int, help="prompts of the cap run (default 1024)")
    p.add_argument("--num-prompts-auto", type=int, help="prompts of the auto run (default 2048)")
    p.add_argument("--num-prompts-overhead", type=int,
                   help="prompts of each (b) run (default 2048; equal to the auto run's, the "
                        "auto run counts as the first 'on' run)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per (b) group")
    p.add_argument("--overhead-design", choices=DESIGNS, default="two-servers",
                   help="see the module docstring")
    p.add_argument("--skip-cap", action="store_true", help="no cap run (and no report)")
    p.add_argument("--skip-overhead", action="store_true", help="no (b)")
    p.add_argument("--server-args", default="", help="extra `moeserve serve` flags of every "
                   "server (e.g. '--device cpu')")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--workers", type=int, default=1, help="bench client processes")
    p.add_argument("--seed", type=int, default=0, help="run i uses seed + i (no prompt repeats)")
    p.add_argument("--server-timeout", type=float, default=300.0,
                   help="seconds to wait for a server's /ready")
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="seconds from the start after which no step is begun that is estimated "
                        "not to finish in time (default 540)")
    a = p.parse_args(argv)
    for name, default in (("cap", 1024), ("auto", 2048), ("overhead", 2048)):
        key = f"num_prompts_{name}"
        if getattr(a, key) is None:
            setattr(a, key, a.num_prompts or default)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`: stop the server
    steps = plan_steps(preset=a.preset, concurrency=a.concurrency, cap=a.cap,
                       n_cap=a.num_prompts_cap, n_auto=a.num_prompts_auto,
                       n_overhead=a.num_prompts_overhead, repeats=a.repeats,
                       design=a.overhead_design, skip_cap=a.skip_cap,
                       skip_overhead=a.skip_overhead)
    st = State(a, out, environment(), steps)
    log(f"doctor acceptance: {len(steps)} steps: {', '.join(s.name for s in steps)}")
    log(f"environment: {json.dumps({k: st.env[k] for k in ('git', 'device', 'torch', 'triton')})}")
    save_state(st)
    try:
        execute(st)
    finally:
        save_state(st)
    ov = st.overhead or {}
    final = {"cap_check": None if st.cap is None else
             {k: st.cap[k] for k in ("pass", "named_in_cap_run", "named_in_auto_run",
                                     "cap_run_rules", "auto_run_rules")},
             "report_pngs_nonempty": (st.report or {}).get("pngs_nonempty"),
             "overhead_pct": ov.get("overhead_pct"), "range": ov.get("overhead_pct_range"),
             "within_2pct": ov.get("within_target"), "design": ov.get("design"),
             "on_tok_s": (ov.get("on") or {}).get("values"),
             "off_tok_s": (ov.get("off") or {}).get("values"),
             "steps": {r["name"]: r.get("status") for r in st.records},
             "elapsed_s": round(time.monotonic() - T0, 1), "out": str(out)}
    log("SUMMARY " + json.dumps(final))
    ok = all(r.get("status") == "ok" for r in st.records)
    return 0 if ok and (st.cap is None or st.cap["pass"]) else 1


if __name__ == "__main__":
    sys.exit(main())
