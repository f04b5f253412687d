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
    python benchmarks/engine/doctor_acceptance.py --out /tmp/doctor_acceptance \
        --bundle $OUT/doctor_acceptance.tar.gz
CPU smoke test (tiny-moe, a minute or so):
    python benchmarks/engine/doctor_acceptance.py --preset tiny-moe --server-args "--device cpu" \
        --concurrency 8 --cap 2 --num-prompts 32 --input-len 32 --output-len 32 --out /tmp/acc

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
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "moeserve.doctor_acceptance/1"
CAP_RULE = "admission_cap"  # moeserve/diagnose/doctor.py: the admission-cap-binding verdict
TARGET_OVERHEAD_PCT = 2.0
ENGINE_COLLECTION_OFF = ("--no-collect-expert-load", "--step-profile-every", "0")
DESIGNS = ("two-servers", "one-server", "restarts")
# first guesses for the deadline check, replaced by what is measured (H200, qwen3-30b-a3b)
DEFAULT_START_S = 90.0
DEFAULT_TPUT = {"cap": 2500.0, "auto": 8000.0}
RUN_SLACK_S = 10.0  # warm-up, workload, the bench's table and the doctor
REPORT_EST_S = 30.0

_T0 = time.monotonic()


def log(msg: str) -> None:
    now = datetime.now().strftime("%H:%M:%S")
    print(f"[{time.monotonic() - _T0:7.1f}s {now}] {msg}", flush=True)


# ---- pure helpers (tests/bench/test_doctor_acceptance.py) -------------------------------------

def group_stats(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the values of one group of throughputs."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "spread_pct": None,
                "values": []}
    med = statistics.median(vals)
    return {"n": len(vals), "median": med, "min": min(vals), "max": max(vals),
            "spread_pct": round(100.0 * (max(vals) - min(vals)) / med, 3) if med else None,
            "values": vals}


def overhead(on: Sequence[float], off: Sequence[float],
             target_pct: float = TARGET_OVERHEAD_PCT) -> dict[str, Any]:
    """Overhead % = 100 x (1 - median_on / median_off), with the range the spread allows
    (best: the fastest "on" against the slowest "off"; worst: the reverse)."""
    g_on, g_off = group_stats(on), group_stats(off)
    out: dict[str, Any] = {"on": g_on, "off": g_off, "overhead_pct": None,
                           "overhead_pct_range": None, "target_pct": target_pct,
                           "within_target": None}
    if g_on["n"] and g_off["n"] and g_off["median"] > 0 and g_off["min"] > 0:
        pct = 100.0 * (1.0 - g_on["median"] / g_off["median"])
        best = 100.0 * (1.0 - g_on["max"] / g_off["min"])
        worst = 100.0 * (1.0 - g_on["min"] / g_off["max"])
        out.update(overhead_pct=round(pct, 3), overhead_pct_range=[round(best, 3),
                                                                   round(worst, 3)],
                   within_target=pct <= target_pct)
    return out


def verdict_rules(verdicts: Sequence[dict[str, Any]] | None) -> list[str]:
    """The rule names of a run's verdicts (res["verdicts"] or one `moeserve doctor --json` line)."""
    return [str(v.get("rule")) for v in verdicts or [] if isinstance(v, dict)]


def cap_check(cap_rules: Sequence[str], auto_rules: Sequence[str]) -> dict[str, Any]:
    """The acceptance: the doctor names the cap in the capped run and not in the auto run."""
    named_cap, named_auto = CAP_RULE in cap_rules, CAP_RULE in auto_rules
    return {"rule": CAP_RULE, "named_in_cap_run": named_cap, "named_in_auto_run": named_auto,
            "pass": named_cap and not named_auto}


def bound_flags(res: dict[str, Any]) -> list[str]:
    """"client_bound" / "api_bound" when the run's client or API process was saturated (the
    doctor's verdicts where it ran, else the bench's own client_bound flag)."""
    flags = {v for v in verdict_rules(res.get("verdicts")) if v in ("client_bound", "api_bound")}
    if res.get("client_bound"):
        flags.add("client_bound")
    return sorted(flags)


@dataclass(frozen=True)
class Step:
    """One step of the plan: a timed bench run, or the report (kind "report")."""

    name: str  # file stem of a run; "report" for the report
    kind: str = "run"  # "run" | "report"
    server: str = ""  # "cap" | "on" | "off": the server configuration it needs
    diagnose: bool = False
    num_prompts: int = 0
    roles: tuple[str, ...] = ()  # "cap", "auto", "on", "off"
    file: str = ""  # path under OUT


def plan_steps(*, preset: str, concurrency: int, cap: int, n_cap: int, n_auto: int,
               n_overhead: int, repeats: int, design: str, skip_cap: bool = False,
               skip_overhead: bool = False) -> list[Step]:
    """The ordered steps. Servers: "cap" (--max-running-requests cap), "on" (defaults: engine
    collection on), "off" (engine collection off); a step on another server than the previous
    one stops the old server and starts the new one."""
    if design not in DESIGNS:
        raise ValueError(f"--overhead-design must be one of {DESIGNS}, got {design!r}")
    stem = f"w1_{preset}_c{concurrency}"
    steps: list[Step] = []
    if not skip_cap:
        steps.append(Step(f"{stem}_cap{cap}", server="cap", diagnose=True, num_prompts=n_cap,
                          roles=("cap",), file=f"{stem}_cap{cap}.jsonl"))
    auto_is_on = not skip_overhead and n_auto == n_overhead
    steps.append(Step(f"{stem}_auto", server="on", diagnose=True, num_prompts=n_auto,
                      roles=("auto", "on") if auto_is_on else ("auto",),
                      file=f"{stem}_auto.jsonl"))
    if not skip_cap:
        steps.append(Step("report", kind="report"))
    if skip_overhead:
        return steps

    def run(role: str, i: int) -> Step:
        server = "on" if role == "on" or design == "one-server" else "off"
        name = f"{stem}_{role}{i}"
        return Step(name, server=server, diagnose=role == "on", num_prompts=n_overhead,
                    roles=(role,), file=f"overhead/{name}.jsonl")

    first_on = 2 if auto_is_on else 1
    if design == "two-servers":
        steps += [run("on", i) for i in range(first_on, repeats + 1)]
        steps += [run("off", i) for i in range(1, repeats + 1)]
    else:  # interleaved: on, off, on, off, ... (the auto run is on #1 when it counts as one)
        for i in range(1, repeats + 1):
            if i >= first_on:
                steps.append(run("on", i))
            steps.append(run("off", i))
    return steps


def slim_result(res: dict[str, Any]) -> dict[str, Any]:
    """Drop the per-chunk arrival lists of the request records (as benchmarks/engine/split_runs.py);
    `num_chunks` keeps their count. The run's figures already summarise them."""
    for r in res.get("requests") or []:
        if isinstance(r, dict) and "chunk_times" in r:
            r["num_chunks"] = len(r.pop("chunk_times") or [])
            r.pop("chunk_tokens", None)
    return res


# ---- environment ----------------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def gpu_info() -> dict[str, Any] | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(h).total)})
        driver = nv.nvmlSystemGetDriverVersion()
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver, "gpus": gpus}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def gpu_memory_used() -> int | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        return sum(int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used)
                   for i in range(nv.nvmlDeviceGetCount()))
    except Exception:
        return None


def environment() -> dict[str, Any]:
    from moeserve.bench.server import git_commit

    gpu = gpu_info()
    names = [g["name"] for g in (gpu or {}).get("gpus", [])]
    return {"git": git_commit(), "device": names[0] if names else platform.processor() or "cpu",
            "gpu": gpu, "torch": _dist_version("torch"), "triton": _dist_version("triton"),
            "python": platform.python_version(), "platform": platform.platform(),
            "argv": sys.argv}


# ---- the server -----------------------------------------------------------------------------

class Server:
    """`moeserve serve` in a subprocess, its log under OUT/logs."""

    def __init__(self, key: str, preset: str, args: list[str], port: int, log_path: Path,
                 ready_timeout_s: float, host: str = "127.0.0.1") -> None:
        from moeserve.bench.server import free_port

        self.key, self.args = key, args
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--host", host,
                    "--port", str(self.port)]
        if "--model" not in args and "--preset" not in args:
            self.cmd += ["--preset", preset]
        self.cmd += args
        self.log_path, self.ready_timeout_s = log_path, ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    def start(self) -> None:
        t = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = t + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before "
                                   f"it was ready; {self.log_path} ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.monotonic() - t
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server was not ready after {self.ready_timeout_s:.0f} s; "
                           f"{self.log_path} ends:\n{self.log_tail()}")

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        from moeserve.bench.server import stop_process

        stop_process(self.proc, grace_s)


def wait_gpu_memory_back(baseline: int | None, timeout_s: float = 60.0) -> None:
    """After a server stops: wait until the GPUs' used memory is back near where it started,
    so the next server sizes its KV cache from the whole memory."""
    if baseline is None:
        return
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        used = gpu_memory_used()
        if used is None or used <= baseline + (2 << 30):
            return
        time.sleep(0.5)
    log(f"warning: GPU memory still {gpu_memory_used() or 0:,} bytes used after {timeout_s:.0f} "
        f"s (baseline {baseline:,})")


# ---- the script ---------------------------------------------------------------------------

@dataclass
class State:
    args: argparse.Namespace
    out: Path
    env: dict[str, Any]
    steps: list[Step]
    started_at: str = field(
        default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    records: list[dict[str, Any]] = field(default_factory=list)  # one per step
    servers: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # step name -> run
    cap: dict[str, Any] | None = None
    report: dict[str, Any] | None = None
    overhead: dict[str, Any] | None = None


def server_args(key: str, args: argparse.Namespace) -> list[str]:
    base = shlex.split(args.server_args)
    if key == "cap":
        return base + ["--max-running-requests", str(args.cap)]
    if key == "off":
        return base + list(ENGINE_COLLECTION_OFF)
    return base


def bench_argv(step: Step, args: argparse.Namespace, seed: int, raw: Path) -> list[str]:
    argv = ["--preset", args.preset, "--workload", "random", "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--range-ratio", "1.0",
            "--num-prompts", str(step.num_prompts), "--max-concurrency", str(args.concurrency),
            "--seed", str(seed), "--workers", str(args.workers), "--no-progress",
            "--output-json", str(raw)]
    return argv + (["--diagnose"] if step.diagnose else [])


def write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_record(res: dict[str, Any]) -> dict[str, Any]:
    client = [c.get("cpu_fraction") for c in res.get("client") or []]
    return {"output_throughput": res.get("output_throughput"), "duration": res.get("duration"),
            "completed": res.get("completed"), "failed": res.get("failed"),
            "median_tpot_ms": res.get("median_tpot_ms"), "client_cpu_fraction": client,
            "server_api_cpu_fraction": res.get("server_api_cpu_fraction"),
            "verdicts": verdict_rules(res.get("verdicts")),
            "diagnose": bool(res.get("diagnostics"))}


def compute_overhead(st: State) -> dict[str, Any] | None:
    runs = [s for s in st.steps if s.kind == "run" and ({"on", "off"} & set(s.roles))]
    if not runs:
        return None
    on = [(s, st.results[s.name]) for s in runs if "on" in s.roles and s.name in st.results]
    off = [(s, st.results[s.name]) for s in runs if "off" in s.roles and s.name in st.results]
    doc = overhead([r["output_throughput"] for _, r in on],
                   [r["output_throughput"] for _, r in off])
    for group, pairs in (("on", on), ("off", off)):
        doc[group]["runs"] = [{"name": s.name, "file": s.file, **run_record(r)} for s, r in pairs]
    a = st.args
    doc.update({
        "schema": SCHEMA + "/overhead", "design": a.overhead_design,
        "what": {"two-servers": "full cost: engine collection (expert-load counters, step "
                                "profile) + client --diagnose, on vs off servers; blocked "
                                "(each server started once)",
                 "one-server": "client-side only: --diagnose on vs off, interleaved, on one "
                               "server with engine collection on",
                 "restarts": "full cost, interleaved: a fresh server per run"}[a.overhead_design],
        "on_server_args": server_args("on", a), "on_client": "--diagnose",
        "off_server_args": server_args("on" if a.overhead_design == "one-server" else "off", a),
        "off_client": "no --diagnose",
        "order": [s.name for s in runs],
        "complete": len(on) == a.repeats and len(off) == a.repeats,
        "repeats": a.repeats, "concurrency": a.concurrency, "preset": a.preset,
        "num_prompts": a.num_prompts_overhead, "input_len": a.input_len,
        "output_len": a.output_len, "metric": "output_throughput (tok/s)",
        "formula": "overhead_pct = 100 x (1 - median_on / median_off); range = "
                   "[1 - max_on / min_off, 1 - min_on / max_off]",
        "failed_requests": sum(r.get("failed") or 0 for _, r in on + off),
        # a saturated client or API process makes the comparison measure it, not the engine
        "bound_runs": {s.name: bound_flags(r) for s, r in on + off if bound_flags(r)},
        "max_client_cpu_fraction": max((c.get("cpu_fraction") or 0.0 for _, r in on + off
                                        for c in r.get("client") or []), default=None),
        "environment": st.env,
    })
    return doc


def save_state(st: State) -> None:
    st.overhead = compute_overhead(st)
    if st.overhead is not None:
        write_json(st.out / "diagnostics_overhead.json", st.overhead)
    ov = st.overhead
    ov_summary = None
    if ov is not None:
        ov_summary = {k: ov.get(k) for k in ("design", "what", "overhead_pct",
                                              "overhead_pct_range", "within_target",
                                              "complete", "target_pct", "failed_requests",
                                              "bound_runs", "max_client_cpu_fraction")}
        for g in ("on", "off"):
            ov_summary[g] = {k: ov[g].get(k) for k in ("n", "median", "min", "max",
                                                        "spread_pct", "values")}
    write_json(st.out / "summary.json", {
        "schema": SCHEMA, "issue": 5, "started_at": st.started_at,
        "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - _T0, 1), "environment": st.env,
        "args": vars(st.args), "plan": [s.name for s in st.steps], "steps": st.records,
        "servers": st.servers, "cap_check": st.cap, "report": st.report,
        "overhead": ov_summary,
    })
    if st.args.bundle:
        bundle(st.out, Path(st.args.bundle))


def bundle(out: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(out.rglob("*")):
                if f.is_file() and f.resolve() not in (path.resolve(), tmp.resolve()) \
                        and not f.name.endswith(".tmp"):
                    tar.add(f, arcname=str(Path(out.name) / f.relative_to(out)))
        os.replace(tmp, path)
    except OSError as e:
        log(f"warning: the bundle {path} failed: {e}")


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
            left = a.deadline_s - (time.monotonic() - _T0)
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
            rec["started_s"] = round(t - _T0, 1)
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
             "elapsed_s": round(time.monotonic() - _T0, 1), "out": str(out)}
    log("SUMMARY " + json.dumps(final))
    ok = all(r.get("status") == "ok" for r in st.records)
    return 0 if ok and (st.cap is None or st.cap["pass"]) else 1


if __name__ == "__main__":
    sys.exit(main())
