"""The pure part of benchmarks/engine/doctor_acceptance/run.py (issue #5's GPU runs), which
tests/bench/test_doctor_acceptance.py covers: the plan of steps (servers and runs in order),
a group's throughput statistics and the diagnostics' overhead between two groups, the doctor's
verdict rules and the cap check over them, a result's bound flags and its slimmed form, each
server's arguments and each run's `moeserve bench` argv.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAP_RULE = "admission_cap"  # moeserve/diagnose/doctor.py: the admission-cap-binding verdict
TARGET_OVERHEAD_PCT = 2.0
DESIGNS = ("two-servers", "one-server", "restarts")
SCHEMA = "moeserve.doctor_acceptance/1"
ENGINE_COLLECTION_OFF = ("--no-collect-expert-load", "--step-profile-every", "0")

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
