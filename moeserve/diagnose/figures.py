"""Figures read out of one bench run's JSON object, for the doctor, the roofline and the report.

A run object (bench/report.py) carries the bench's figures at the top level, GET /v1/engine under
"engine" (capacity_report, stats, server), the engine counters' growth over the timed run under
"engine_run" (bench/engine_run.py: "counters" and per-step figures) and, with `moeserve bench
--diagnose`, this under "diagnostics" (bench/diagnostics.py writes it; every `t` is seconds on
the run's clock, 0 = the start of the timed run, `duration` = its end):

    engine_timeline  {"available", "reason", "interval_s", "t": [...],
                      "stats": {"num_running": [...], "num_waiting": [...], ...}}   GET /v1/engine
    gpu              {"available", "reason", "interval_s", "t": [...], "devices": [{"index",
                      "name", "power_limit_w", "memory_total_mib", "power_w": [...],
                      "sm_clock_mhz": [...], "util_pct": [...], "memory_used_mib": [...]}]}  NVML
    cpu              {"available", "reason", "interval_s", "t": [...], "processes": [{"pid",
                      "role": "api" | "engine" | "launcher", "cpu_fraction": [...]}]}  psutil
    expert_load      {"num_steps", "tokens_per_expert": [[E ints] per MoE layer]} or null:
                     the engine's counters over the run (a run-level "expert_load" is read too)

Every function here is pure and tolerant of a part being absent (it returns None or an empty
result); malformed data that is present raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Series = list[float | None]


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def capacity_report(run: dict[str, Any]) -> dict[str, Any]:
    """The server's capacity report ({} for a foreign server)."""
    return _dict(_dict(run.get("engine")).get("capacity_report"))


def engine_config(run: dict[str, Any]) -> dict[str, Any]:
    """The resolved engine config from the capacity report ({} when unknown)."""
    return _dict(capacity_report(run).get("engine_config"))


def engine_run(run: dict[str, Any]) -> dict[str, Any]:
    """What the engine did in the timed run: its counters' growth ("counters") and the figures
    derived from them (bench/engine_run.py); {} for a server without /v1/engine."""
    return _dict(run.get("engine_run"))


def run_counters(run: dict[str, Any]) -> dict[str, Any]:
    """The engine counters' growth over the timed run ({} when unknown). Counters are
    count-uniform: unlike a gauge sampled now and then, every step adds to them."""
    return _dict(engine_run(run).get("counters"))


SLOW_STEP_FIELDS = ("step", "seconds", "prompt_tokens", "decode_rows", "generated_tokens")


def slow_steps(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's slow steps (engine_run.slow_steps: bench/engine_run.py), [] when absent;
    ValueError naming the field for a malformed one."""
    steps = engine_run(run).get("slow_steps")
    if steps is None:
        return []
    if not isinstance(steps, list):
        raise ValueError(f"engine_run.slow_steps must be a list, got {type(steps).__name__}")
    for i, s in enumerate(steps):
        bad = [k for k in SLOW_STEP_FIELDS if not isinstance(s, dict)
               or not isinstance(s.get(k), int | float) or isinstance(s.get(k), bool)]
        if bad:
            raise ValueError(f"engine_run.slow_steps[{i}] needs numbers {', '.join(bad)}")
    return steps


def _positive_int(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def torch_threads(run: dict[str, Any]) -> int | None:
    """torch's CPU threads in the engine process: the capacity report's, else the resolved
    engine config's (an int once resolved)."""
    return (_positive_int(capacity_report(run).get("torch_threads"))
            or _positive_int(engine_config(run).get("torch_threads")))


def usable_cores(run: dict[str, Any]) -> int | None:
    """The cores the engine process may run on (its CPU affinity), from the capacity report."""
    return _positive_int(capacity_report(run).get("usable_cores"))


def engine_section(run: dict[str, Any], name: str) -> dict[str, Any]:
    """One nested part of the resolved engine config: "cache" or "scheduler" ({} unknown)."""
    return _dict(engine_config(run).get(name))


def server_settings(run: dict[str, Any]) -> dict[str, Any]:
    return _dict(_dict(run.get("engine")).get("server"))


def diagnostics(run: dict[str, Any]) -> dict[str, Any]:
    return _dict(run.get("diagnostics"))


def max_running_cap(run: dict[str, Any]) -> int | None:
    """The engine's admission cap (resolved), from the capacity report or the server."""
    for doc in (capacity_report(run), server_settings(run)):
        cap = doc.get("max_running_requests")
        if isinstance(cap, int) and not isinstance(cap, bool):
            return cap
    return None


def kv_tokens(run: dict[str, Any]) -> int | None:
    rep = capacity_report(run)
    value = rep.get("kv_tokens", _dict(rep.get("memory")).get("num_kv_tokens"))
    return value if isinstance(value, int) else None


def device_kind(run: dict[str, Any]) -> str:
    """"cuda", "cpu" or "" (unknown), from the resolved engine config."""
    dev = str(engine_config(run).get("device") or "")
    return "cuda" if dev.startswith("cuda") else dev


def request_footprint(run: dict[str, Any]) -> float | None:
    """Mean tokens a request may hold in the KV cache (prompt + max output tokens)."""
    reqs = run.get("requests")
    if isinstance(reqs, list) and reqs:
        return sum(r.get("prompt_len", 0) + r.get("max_tokens", 0) for r in reqs) / len(reqs)
    cfg = _dict(run.get("config"))
    if isinstance(cfg.get("input_len"), int) and isinstance(cfg.get("output_len"), int):
        return float(cfg["input_len"] + cfg["output_len"])
    done = run.get("completed") or 0
    if done:
        return (run.get("total_input_tokens", 0) + run.get("total_output_tokens", 0)) / done
    return None


def mean_decode_context(run: dict[str, Any]) -> float | None:
    """Mean context a decode step attends over: prompt + half the output, per request."""
    reqs = run.get("requests")
    if isinstance(reqs, list) and reqs:
        return sum(r.get("prompt_len", 0) + r.get("max_tokens", 0) / 2 for r in reqs) / len(reqs)
    fp = request_footprint(run)
    cfg = _dict(run.get("config"))
    if fp is not None and isinstance(cfg.get("output_len"), int):
        return fp - cfg["output_len"] / 2
    return fp


def client_concurrency(run: dict[str, Any]) -> int:
    """The client's in-flight cap: max_concurrency, else every prompt at once."""
    conc = run.get("max_concurrency")
    return int(conc) if isinstance(conc, int) else int(run.get("num_prompts") or 0)


# ---- time series -------------------------------------------------------------------------------

def _columns(part: dict[str, Any], name: str) -> list[float]:
    t = part.get("t")
    if t is None:
        return []
    if not isinstance(t, list):
        raise ValueError(f"diagnostics.{name}.t must be a list, got {type(t).__name__}")
    return t


def _in_run(t: list[float], duration: float | None) -> list[int]:
    """Indices of samples inside the timed run [0, duration]."""
    end = duration if duration is not None else float("inf")
    return [i for i, x in enumerate(t) if 0.0 <= x <= end]


def engine_series(run: dict[str, Any], key: str, in_run: bool = True
                  ) -> tuple[list[float], Series]:
    """(t, values) of one engine stat from the timeline; ([], []) when absent."""
    tl = _dict(diagnostics(run).get("engine_timeline"))
    t = _columns(tl, "engine_timeline")
    values = _dict(tl.get("stats")).get(key)
    if not t or not isinstance(values, list):
        return [], []
    if len(values) != len(t):
        raise ValueError(f"diagnostics.engine_timeline.stats.{key} has {len(values)} values "
                         f"for {len(t)} times")
    idx = _in_run(t, run.get("duration")) if in_run else list(range(len(t)))
    return [t[i] for i in idx], [values[i] for i in idx]


def mean(values: Series) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass(frozen=True, slots=True)
class Window:
    """The steady part of a run: from the first to the last sample with the batch near its peak
    (num_running >= 90% of the run's peak), with the engine counters' deltas over it."""

    t0: float
    t1: float
    num_samples: int
    steps: float
    generated_tokens: float
    prompt_tokens: float
    mean_running: float
    mean_waiting: float

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0

    @property
    def step_seconds(self) -> float | None:
        return self.seconds / self.steps if self.steps > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        return (self.prompt_tokens + self.generated_tokens) / self.steps if self.steps else None


def steady_window(run: dict[str, Any], peak_share: float = 0.9) -> Window | None:
    """The steady window of the engine timeline, or None with fewer than two samples in it."""
    t, running = engine_series(run, "num_running")
    if len(t) < 2 or not any(r for r in running if r):
        return None
    peak = max(r for r in running if r is not None)
    near = [i for i, r in enumerate(running) if r is not None and r >= peak_share * peak]
    i0, i1 = near[0], near[-1]
    if i1 <= i0:
        return None

    def delta(key: str) -> float:
        _, vals = engine_series(run, key)
        if not vals or vals[i0] is None or vals[i1] is None:
            return 0.0
        return float(vals[i1] - vals[i0])

    _, waiting = engine_series(run, "num_waiting")
    mean_waiting = (mean(waiting[i0:i1 + 1]) or 0.0) if waiting else 0.0
    return Window(t0=t[i0], t1=t[i1], num_samples=i1 - i0 + 1, steps=delta("num_steps"),
                  generated_tokens=delta("num_generated_tokens"),
                  prompt_tokens=delta("num_prompt_tokens"),
                  mean_running=mean(running[i0:i1 + 1]) or 0.0,
                  mean_waiting=mean_waiting)


@dataclass(frozen=True, slots=True)
class GpuFigures:
    """One GPU over the timed run (means of its samples)."""

    index: int
    name: str
    power_limit_w: float | None
    mean_power_w: float | None
    mean_util_pct: float | None
    mean_sm_clock_mhz: float | None
    max_memory_used_mib: float | None
    num_samples: int


def gpu_figures(run: dict[str, Any]) -> list[GpuFigures]:
    """Per GPU figures over the run; [] without NVML samples."""
    gpu = _dict(diagnostics(run).get("gpu"))
    t = _columns(gpu, "gpu")
    idx = _in_run(t, run.get("duration"))
    out = []
    for dev in gpu.get("devices") or []:
        def col(key: str, dev: dict[str, Any] = dev) -> Series:
            vals = dev.get(key) or []
            if len(vals) != len(t):
                raise ValueError(f"diagnostics.gpu.devices[{dev.get('index')}].{key} has "
                                 f"{len(vals)} values for {len(t)} times")
            return [vals[i] for i in idx]

        mem = [m for m in col("memory_used_mib") if m is not None]
        out.append(GpuFigures(index=int(dev.get("index", len(out))), name=str(dev.get("name")),
                              power_limit_w=dev.get("power_limit_w"),
                              mean_power_w=mean(col("power_w")),
                              mean_util_pct=mean(col("util_pct")),
                              mean_sm_clock_mhz=mean(col("sm_clock_mhz")),
                              max_memory_used_mib=max(mem) if mem else None, num_samples=len(idx)))
    return out


def busy_gpus(gpus: list[GpuFigures]) -> list[GpuFigures]:
    """The GPUs the server used: those with >= 5% mean utilisation, else the busiest one (a host
    with 8 GPUs and a one-GPU engine must not be judged by its idle GPUs)."""
    busy = [g for g in gpus if (g.mean_util_pct or 0.0) >= 5.0]
    if busy or not gpus:
        return busy
    return [max(gpus, key=lambda g: (g.mean_util_pct or 0.0, g.mean_power_w or 0.0))]


def process_cpu(run: dict[str, Any]) -> dict[str, list[float]]:
    """Mean CPU use (cores) over the run of each sampled server process, grouped by role."""
    cpu = _dict(diagnostics(run).get("cpu"))
    idx = _in_run(_columns(cpu, "cpu"), run.get("duration"))
    out: dict[str, list[float]] = {}
    for p in cpu.get("processes") or []:
        vals = p.get("cpu_fraction") or []
        m = mean([vals[i] for i in idx if i < len(vals)])
        if m is not None:
            out.setdefault(str(p.get("role")), []).append(m)
    return out
