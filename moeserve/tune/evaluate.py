"""One measurement of one config: a real `moeserve serve` and a real `moeserve bench` against it.

    Outcome                   what a trial records: the objective, every figure of each bench
                              run, the doctor's verdicts, the capacity report, or the failure
                              (its kind and reason)
    Evaluator                 the interface the study loop calls: evaluate(params, purpose)
    ServerBenchEvaluator      start the server with the fixed arguments + the config's flags,
                              wait for /ready, run the bench (a subprocess, with --diagnose)
                              at each concurrency, stop the server; classify what went wrong

Failure kinds, each an infeasible trial and never an abort of the study:

    invalid    the engine refuses the combination (ConfigError; found before any start)
    oom        out of memory, at start-up or during the run (the server's log says so)
    startup    the server exited before /ready, or was not ready in time
    crash      the server died during the bench
    timeout    the bench ran past the trial's time limit
    failed     the bench completed, but requests failed (none at all, or some)
    slo        the run's latency broke the bound (a feasible measurement, kept with its value)

The bench runs as a subprocess so that a trial's time limit can end it, and a bench that
fails cannot take the study with it. Its JSON lines are read back: every figure is kept in
the ledger (`figures_of`); the per-request records, the timelines and the /v1/engine document
are not (their figures are, and the capacity report is kept once per trial).
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moeserve.bench.server import ServerProcess, find_key

FAILURE_KINDS = ("invalid", "oom", "startup", "crash", "timeout", "failed", "slo")
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "cuda error: out of memory",
                "cannot allocate memory", "memoryerror")
# parts of a bench result kept whole beside its scalar figures
KEPT = ("engine_run", "warnings", "client")


@dataclass(frozen=True, slots=True)
class Slo:
    """A latency bound on every run of a trial: p99 (or median) TPOT and TTFT in ms."""

    tpot_ms: float | None = None
    ttft_ms: float | None = None
    stat: str = "p99"  # p99 | median

    def violations(self, run: Mapping[str, Any]) -> list[str]:
        out = []
        for name, bound in (("tpot", self.tpot_ms), ("ttft", self.ttft_ms)):
            value = run.get(f"{self.stat}_{name}_ms")
            if bound is not None and isinstance(value, int | float) and value > bound:
                out.append(f"{self.stat} {name.upper()} {value:.1f} ms > {bound:g} ms at "
                           f"concurrency {run.get('max_concurrency')}")
        return out

    def excess(self, runs: Sequence[Mapping[str, Any]]) -> float:
        """The worst relative excess over the bounds (<= 0: met), Optuna's constraint value."""
        worst = -1.0
        for run in runs:
            for name, bound in (("tpot", self.tpot_ms), ("ttft", self.ttft_ms)):
                value = run.get(f"{self.stat}_{name}_ms")
                if bound is not None and isinstance(value, int | float):
                    worst = max(worst, value / bound - 1.0)
        return worst


@dataclass(slots=True)
class Outcome:
    """What one evaluation of a config gave. `value` is the objective (output tok/s; the
    geometric mean over the concurrencies), None when the trial is infeasible (`failure`)."""

    value: float | None
    runs: list[dict[str, Any]] = field(default_factory=list)  # figures_of() per concurrency
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # doctor.Verdict.to_dict()
    capacity: dict[str, Any] | None = None
    failure: str | None = None  # one of FAILURE_KINDS
    error: str | None = None
    seconds: float = 0.0
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # evaluator-specific figures

    def __post_init__(self) -> None:
        if self.failure is not None and self.failure not in FAILURE_KINDS:
            raise ValueError(f"failure must be one of {FAILURE_KINDS}, got {self.failure!r}")



def objective(runs: Sequence[Mapping[str, Any]]) -> float:
    """Output tok/s, the geometric mean over the runs (one per concurrency)."""
    values = [max(float(r.get("output_throughput") or 0.0), 1e-9) for r in runs]
    return math.exp(sum(math.log(v) for v in values) / len(values))


class Evaluator(Protocol):
    def evaluate(self, params: Mapping[str, Any], purpose: str) -> Outcome:
        """Measure one config; `purpose` is "trial" (the bounded benchmark) or "confirm" (the
        full workload). Never raises for a failing config: the Outcome says what failed."""
        ...


def classify_log(text: str) -> str | None:
    low = text.lower()
    return "oom" if any(m in low for m in _OOM_MARKERS) else None


@dataclass(slots=True)
class BenchPlan:
    """What each trial's bench runs: the concurrencies, prompts per run (trial and
    confirmation), extra bench flags (the workload: W1's defaults otherwise)."""

    concurrencies: list[int]
    trial_prompts: Callable[[int], int] = lambda c: c
    confirm_prompts: Callable[[int], int] = lambda c: 3 * c
    bench_args: list[str] = field(default_factory=list)
    diagnose: bool = True


class ServerBenchEvaluator:
    """The real thing: `moeserve serve` with the config, `moeserve bench --url` against it."""

    def __init__(self, preset_or_model: str, fixed_args: Sequence[str], plan: BenchPlan,
                 slo: Slo | None = None, trial_timeout_s: float = 600.0,
                 server_timeout_s: float = 900.0, log_dir: Path | None = None,
                 flags_of: Callable[[Mapping[str, Any]], list[str]] | None = None) -> None:
        from moeserve.tune.space import server_flags

        self.model = preset_or_model
        self.fixed = list(fixed_args)
        self.plan = plan
        self.slo = slo or Slo()
        self.trial_timeout_s = trial_timeout_s
        self.server_timeout_s = server_timeout_s
        self.log_dir = log_dir
        self.flags_of = flags_of or server_flags
        self._count = 0

    def server_args(self, params: Mapping[str, Any]) -> list[str]:
        """The `moeserve serve` arguments of a config: the model, the fixed ones, its flags."""
        args = [*self.fixed, *self.flags_of(params)]
        return args if "--model" in args or "--preset" in args else ["--model", self.model, *args]

    def command(self, params: Mapping[str, Any]) -> list[str]:
        return ["moeserve", "serve", *self.server_args(params)]

    def evaluate(self, params: Mapping[str, Any], purpose: str) -> Outcome:
        start = time.monotonic()
        self._count += 1
        server_args = self.server_args(params)
        out = Outcome(None, command=shlex.join(self.command(params)))
        server = ServerProcess(self.model, shlex.join(server_args),
                               ready_timeout_s=self.server_timeout_s)
        try:
            try:
                server.__enter__()
            except RuntimeError as e:
                text = str(e)
                out.failure = classify_log(text) or "startup"
                out.error = _last_lines(text, 12)
                return out
            self._bench(server, purpose, out)
            if out.failure in (None, "failed") and _exited(server, 0.0 if out.failure is None
                                                           else _DEATH_GRACE_S):
                log = server.log_tail(40)
                out.failure = classify_log(log) or "crash"
                out.error = (f"the server exited with code {server.proc.returncode} during the "
                             "bench: " + _last_lines(log, 12))
        finally:
            log = server.log_tail(200) if Path(server.log.name).exists() else ""
            server.stop(keep_log=False)
            out.seconds = time.monotonic() - start
            self._keep_log(log, out)
        if out.failure is None and out.runs:
            out.value = objective(out.runs)
            violations = [v for r in out.runs for v in self.slo.violations(r)]
            if violations:
                out.failure, out.error = "slo", "; ".join(violations)
                out.extra["slo_excess"] = self.slo.excess(out.runs)
        return out

    def bench_limit_s(self, purpose: str) -> float:
        """Seconds a bench may run: --trial-timeout for a trial; a confirmation run, with
        more prompts, gets as many times more (the start's full W1 is 3x its trial)."""
        if purpose == "trial":
            return self.trial_timeout_s
        ratio = max(self.plan.confirm_prompts(c) / max(1, self.plan.trial_prompts(c))
                    for c in self.plan.concurrencies)
        return self.trial_timeout_s * max(1.0, ratio)

    def _bench(self, server: ServerProcess, purpose: str, out: Outcome) -> None:
        num = self.plan.trial_prompts if purpose == "trial" else self.plan.confirm_prompts
        limit = self.bench_limit_s(purpose)
        with tempfile.TemporaryDirectory(prefix="moeserve-tune-") as tmp:
            results = Path(tmp) / "bench.jsonl"
            deadline = time.monotonic() + limit
            for conc in self.plan.concurrencies:
                cmd = [sys.executable, "-m", "moeserve.cli", "bench", "--url", server.url,
                       "--max-concurrency", str(conc), "--num-prompts", str(num(conc)),
                       "--output-json", str(results), "--no-progress", *self.plan.bench_args]
                if self.plan.diagnose:
                    cmd.append("--diagnose")
                left = deadline - time.monotonic()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True,
                                          timeout=max(1.0, left))
                except subprocess.TimeoutExpired:
                    out.failure = "timeout"
                    out.error = (f"the bench at concurrency {conc} ran past its {limit:.0f} s "
                                 f"(--trial-timeout {self.trial_timeout_s:.0f} s"
                                 + ("" if purpose == "trial" else ", scaled by the "
                                    "confirmation's prompts") + ")")
                    return
                if _exited(server, 0.0):
                    return  # evaluate() says how it died
                if proc.returncode not in (0, 1):
                    out.failure = "failed"
                    out.error = f"moeserve bench exited {proc.returncode}: " + \
                        _last_lines(proc.stderr or proc.stdout, 12)
                    return
            self._read(results, out)

    def _read(self, path: Path, out: Outcome) -> None:
        from moeserve.diagnose import doctor

        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            res = json.loads(line)
            out.runs.append(figures_of(res))
            out.verdicts += [v.to_dict() | {"max_concurrency": res.get("max_concurrency")}
                             for v in doctor.diagnose(res)]
            if out.capacity is None:
                out.capacity = find_key(res.get("engine"), "capacity_report")
        bad = [r for r in out.runs if (r.get("failed") or 0) > 0 or not r.get("completed")]
        if not out.runs:
            out.failure, out.error = "failed", "the bench wrote no result"
        elif bad:
            r = bad[0]
            out.failure = "failed"
            out.error = (f"{r.get('failed')} of {r.get('num_prompts')} requests failed at "
                         f"concurrency {r.get('max_concurrency')}")

    def _keep_log(self, log: str, out: Outcome) -> None:
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"server_{time.strftime('%Y%m%d-%H%M%S')}_{self._count}.log"
        path.write_text(f"$ {out.command}\n{log}\n")
        out.extra["server_log"] = str(path)


def figures_of(res: Mapping[str, Any]) -> dict[str, Any]:
    """Every figure of a bench result (its scalar fields: bench_serving's metrics, the
    identity of the run, server API CPU), with the engine's counters over the run and the
    client's CPU; not the per-request records, the /v1/engine document or the timelines."""
    out = {k: v for k, v in res.items()
           if v is None or isinstance(v, str | int | float | bool)}
    return out | {k: res.get(k) for k in KEPT}


_DEATH_GRACE_S = 15.0  # a bench that failed: the server may be on its way out (exit 3)


def _exited(server: ServerProcess, grace_s: float) -> bool:
    """Whether the server process has exited, waiting up to `grace_s` for it."""
    if server.proc is None:
        return False
    try:
        server.proc.wait(timeout=grace_s) if grace_s > 0 else None
    except subprocess.TimeoutExpired:
        return False
    return server.proc.poll() is not None


def _last_lines(text: str, n: int) -> str:
    return "\n".join((text or "").strip().splitlines()[-n:])

