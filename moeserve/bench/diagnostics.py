"""`moeserve bench --diagnose`: telemetry around each timed run, then the doctor's verdicts.

    RunDiagnostics.start()        right before the timed run, three sampler threads:
      engine timeline             GET /v1/engine every 250 ms: its "stats" (num_running,
                                  num_waiting, kv_usage, num_steps, num_preemptions, ...), and the
                                  engine's expert_load counters when it exposes them
      gpu                         NVML every 100 ms (diagnose/telemetry.py), when a GPU is found
      cpu                         psutil every 100 ms: the server's processes by role (api,
                                  engine, launcher), only when the bench started the server
    RunDiagnostics.stop(duration) right after it: one last engine sample (end-of-run counters),
                                  then the run's `diagnostics` object (diagnose/figures.py
                                  documents it)
    attach(res, diagnostics)      res["diagnostics"], then the doctor on the whole run object:
                                  res["verdicts"]; `print_verdicts` shows them after the table

The clock: samplers stamp time.perf_counter(); the timed run's start is taken as (the moment
run_timed returned - the run's duration), no earlier than when the samplers started, so every
`t` is seconds from the run's start, as the request records' `start` is. The error is the time
between the last response and run_timed's return (milliseconds with one client process; more
with --workers, which join their processes first).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from rich.console import Console

from moeserve.diagnose import doctor, expert_load
from moeserve.diagnose.telemetry import GpuSampler, Periodic, ProcessCpuSampler, server_processes

ENGINE_INTERVAL_S = 0.25
GPU_INTERVAL_S = 0.1
CPU_INTERVAL_S = 0.1
SCHEMA = "moeserve.diagnostics/1"


class EngineTimeline:
    """GET /v1/engine's stats, one row per sample; numeric fields become columns."""

    def __init__(self, base_url: str, api_key: str | None, interval_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.url = base_url.rstrip("/") + "/v1/engine"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval_s = interval_s
        self._clock = clock
        self.t: list[float] = []
        self.rows: list[dict[str, float]] = []
        self.errors = 0
        self.last_error: str | None = None
        self.first_load: dict[str, Any] | None = None
        self.last_load: dict[str, Any] | None = None

    def sample(self, now: float) -> None:
        t0 = self._clock()
        try:
            req = urllib.request.Request(self.url, headers=self.headers)
            with urllib.request.urlopen(req, timeout=2.0) as resp:
                doc = json.loads(resp.read())
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            return
        stats = doc.get("stats") if isinstance(doc, dict) else None
        if not isinstance(stats, dict):
            self.errors += 1
            self.last_error = "GET /v1/engine has no 'stats' object"
            return
        self.t.append((t0 + self._clock()) / 2)
        self.rows.append({k: v for k, v in stats.items()
                          if isinstance(v, int | float) and not isinstance(v, bool)})
        load = stats.get("expert_load", doc.get("expert_load"))
        if isinstance(load, dict):
            if self.first_load is None:
                self.first_load = load
            self.last_load = load

    def to_dict(self, origin: float) -> dict[str, Any]:
        keys = sorted({k for row in self.rows for k in row})
        return {"available": bool(self.rows),
                "reason": None if self.rows else f"no sample: {self.last_error}",
                "interval_s": self.interval_s,
                "t": [round(x - origin, 4) for x in self.t],
                "stats": {k: [row.get(k) for row in self.rows] for k in keys},
                "errors": self.errors, "last_error": self.last_error}


class RunDiagnostics:
    """The samplers of one timed run (see the module docstring).

    Args:
        base_url, api_key: the server.
        has_engine_route: False for a server without /v1/engine (no timeline then).
        server: (pid, port) of the `moeserve serve` the bench started, else None (no CPU series).
        nvml: a pynvml-like module (tests); None imports pynvml.
        clock: what every sample and the run's start and end are stamped with (tests).
    """

    def __init__(self, base_url: str, api_key: str | None, has_engine_route: bool,
                 server: tuple[int, int] | None, nvml: Any | None = None,
                 engine_interval_s: float = ENGINE_INTERVAL_S,
                 gpu_interval_s: float = GPU_INTERVAL_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.timeline = EngineTimeline(base_url, api_key, engine_interval_s, clock) \
            if has_engine_route else None
        self.gpu = GpuSampler(gpu_interval_s, nvml)
        self.cpu: ProcessCpuSampler | None = None
        self.cpu_reason: str | None = ("the bench did not start the server (--url): its "
                                       "processes are not sampled")
        if server is not None:
            self.cpu = ProcessCpuSampler(server_processes(*server), CPU_INTERVAL_S)
            self.cpu_reason = None
        self._threads: list[Periodic] = []
        self._t_start = 0.0

    def start(self) -> None:
        self._t_start = self._clock()
        if self.timeline is not None:
            self._threads.append(Periodic(self.timeline.interval_s, self.timeline.sample,
                                          "moeserve-diag-engine", self._clock))
        if self.gpu.open():
            self._threads.append(Periodic(self.gpu.interval_s, self.gpu.sample,
                                          "moeserve-diag-gpu", self._clock))
        if self.cpu is not None:
            self._threads.append(Periodic(self.cpu.interval_s, self.cpu.sample,
                                          "moeserve-diag-cpu", self._clock))
        for th in self._threads:
            th.start()

    def stop(self, duration: float | None) -> dict[str, Any]:
        """Stop sampling; the run's diagnostics object (`duration` None: the run failed)."""
        t_end = self._clock()
        for th in self._threads:
            th.stop()
        self.gpu.close()
        if self.timeline is not None:
            self.timeline.sample(self._clock())  # the end-of-run counters
        origin = self._t_start if duration is None else max(self._t_start, t_end - duration)
        errors = {th.name: th.error for th in self._threads if th.error}
        return {
            "schema": SCHEMA,
            "clock": {"origin": "start of the timed run = return of run_timed - duration",
                      "slack_s": round(origin - self._t_start, 4)},
            "engine_timeline": (self.timeline.to_dict(origin) if self.timeline is not None else
                                {"available": False, "reason": "the server has no /v1/engine",
                                 "t": [], "stats": {}}),
            "gpu": self.gpu.to_dict(origin),
            "cpu": (self.cpu.to_dict(origin) if self.cpu is not None else
                    {"available": False, "reason": self.cpu_reason, "t": [], "processes": []}),
            "expert_load": (expert_load.run_delta(self.timeline.first_load,
                                                  self.timeline.last_load)
                            if self.timeline is not None else None),
            "sampler_errors": errors,
        }


def attach(res: dict[str, Any], diagnostics: dict[str, Any]) -> list[doctor.Verdict]:
    """Store the diagnostics in the run object, run the doctor on it, store its verdicts. A
    doctor that fails must not cost the run's results: its error goes into res["warnings"]
    (and the verdicts stay empty) and `moeserve doctor` can be run on the line later."""
    res["diagnostics"] = diagnostics
    try:
        verdicts = doctor.diagnose(res)
    except Exception as e:
        res["warnings"] = [*res.get("warnings", []), f"the doctor failed: {type(e).__name__}: {e}"]
        verdicts = []
    res["verdicts"] = [v.to_dict() for v in verdicts]
    return verdicts


def print_verdicts(console: Console, res: dict[str, Any], verdicts: list[doctor.Verdict]) -> None:
    """The doctor's summary and verdicts under the run's table."""
    console.print("Doctor", style="bold")
    for line in doctor.summary_lines(res):
        console.print(f"  {line}", highlight=False, markup=False)
    diag = res.get("diagnostics") or {}
    for part in ("engine_timeline", "gpu", "cpu"):
        info = diag.get(part) or {}
        if not info.get("available", True):
            console.print(f"  no {part} samples: {info.get('reason')}", highlight=False,
                          markup=False)
    for name, error in (diag.get("sampler_errors") or {}).items():
        console.print(f"  sampler {name} stopped early: {error}", highlight=False, markup=False)
    for w in res.get("warnings", []):
        if w.startswith("the doctor failed"):
            console.print(f"  {w}", highlight=False, markup=False)
    for line in doctor.format_verdicts(verdicts):
        console.print(f"  {line}", highlight=False, markup=False)
