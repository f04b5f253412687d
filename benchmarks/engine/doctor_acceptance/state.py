"""The record of benchmarks/engine/doctor_acceptance/run.py's run (issue #5's GPU runs): its
`State` (the plan, each step's record, the servers, the results), the diagnostics' overhead
document computed from the results so far, and summary.json / diagnostics_overhead.json (and
the --bundle tarball) rewritten after every step, so a run killed at its time limit still
leaves its data; `log`, the run's timestamped lines.
"""

from __future__ import annotations

import argparse
import json
import os
import tarfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.engine.doctor_acceptance.plan import (
    SCHEMA,
    Step,
    bound_flags,
    overhead,
    server_args,
    verdict_rules,
)

T0 = time.monotonic()  # the run's start: log lines and elapsed times count from it


def log(msg: str) -> None:
    now = datetime.now().strftime("%H:%M:%S")
    print(f"[{time.monotonic() - T0:7.1f}s {now}] {msg}", flush=True)


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
        "elapsed_s": round(time.monotonic() - T0, 1), "environment": st.env,
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
