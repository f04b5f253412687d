"""What the engine did during one timed run: the difference of two /v1/engine stats snapshots.

Owns `engine_snapshot` (the stats object of GET /v1/engine, or None for a server without it)
and `engine_run` (the run's share of the engine's cumulative counters, with per-step means):
how many steps it took, how many replayed a CUDA graph, how many decode batches fell back to
eager, its slow steps (the engine's latest steps of 0.25 s or more, with what they held), where
a busy engine-loop iteration's wall time went (core.step(), request intake, sending outputs),
and over the step profile's sampled forwards the wall time of their steps against their device
time (per forward: a multi-step plan runs several). A result without these cannot say whether a
slow run was the GPU's or the host's; the /v1/engine document fetched before the run
(provenance) holds only the start.
"""

from __future__ import annotations

from typing import Any

from moeserve.bench.server import get_json

# cumulative fields of the engine's stats (moeserve/engine/process/protocol.py EngineStats)
COUNTERS = ("num_steps", "num_forward_steps", "num_graph_steps", "num_mixed_graph_steps",
            "cuda_graph_fallbacks",
            "num_preemptions", "num_prefix_hit_tokens", "num_prompt_tokens",
            "num_generated_tokens", "num_aborted", "num_failed", "num_refused", "num_oom_steps",
            "num_grammar_waits", "num_recorded_steps",
            "num_busy_iterations",
            "busy_loop_seconds_total", "busy_step_seconds_total", "busy_intake_seconds_total",
            "busy_send_seconds_total", "num_profiled_forwards", "profiled_device_seconds_total",
            "profiled_wall_seconds_total")


def engine_snapshot(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """The engine's stats now, or None when the server has no /v1/engine or cannot be read."""
    try:
        doc = get_json(base_url, "/v1/engine", api_key)
    except ValueError:
        return None
    stats = doc.get("stats") if isinstance(doc, dict) else None
    return stats if isinstance(stats, dict) else None


def engine_run(before: dict[str, Any] | None, after: dict[str, Any] | None,
               duration_s: float) -> dict[str, Any] | None:
    """The counters' growth from `before` to `after` plus derived figures, or None when either
    snapshot is missing. Fields missing from a snapshot (an older server) are left out."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in COUNTERS
             if isinstance(after.get(k), int | float) and isinstance(before.get(k), int | float)}
    out: dict[str, Any] = {"counters": delta}
    steps, iters = delta.get("num_steps"), delta.get("num_busy_iterations")
    forwards = delta.get("num_forward_steps")
    if forwards and "num_graph_steps" in delta:  # of the model forwards, graph replays
        out["graph_step_share"] = delta["num_graph_steps"] / forwards
    if forwards and "num_mixed_graph_steps" in delta:  # ... and piecewise mixed replays
        out["mixed_graph_step_share"] = delta["num_mixed_graph_steps"] / forwards
    if steps:
        if "num_generated_tokens" in delta:
            out["generated_tokens_per_step"] = delta["num_generated_tokens"] / steps
    if iters:
        for key in ("loop", "step", "intake", "send"):
            total = delta.get(f"busy_{key}_seconds_total")
            if total is not None:
                out[f"mean_{key}_ms"] = 1e3 * total / iters
    if forwards and "busy_step_seconds_total" in delta:
        out["step_ms_per_forward"] = 1e3 * delta["busy_step_seconds_total"] / forwards
    profiled = delta.get("num_profiled_forwards")
    if profiled and "profiled_device_seconds_total" in delta:  # the same forwards, both ways
        device, wall = delta["profiled_device_seconds_total"], delta["profiled_wall_seconds_total"]
        out["profiled_device_ms_per_forward"] = 1e3 * device / profiled
        out["profiled_wall_ms_per_forward"] = 1e3 * wall / profiled
        if device > 0:
            out["profiled_wall_over_device"] = wall / device
    busy = delta.get("busy_loop_seconds_total")
    if busy is not None and duration_s > 0:
        out["busy_share"] = busy / duration_s  # of the run's wall time, the loop had work
    slow = run_slow_steps(before, after)
    if slow is not None:
        out["slow_steps"] = slow
    return out


def run_slow_steps(before: dict[str, Any], after: dict[str, Any]) -> list[dict] | None:
    """The engine's slow steps (engine/step_counters.py) numbered within the run, numbered from
    its first step: [{"step", "seconds", "prompt_tokens", "decode_rows", "generated_tokens"}];
    None for a server
    without them. The engine keeps only its latest few: a run with more keeps the last."""
    start, slow = before.get("num_recorded_steps"), after.get("slow_steps")
    if not isinstance(start, int) or not isinstance(slow, list):
        return None
    return [{"step": n - start, "seconds": seconds, "prompt_tokens": prompt,
             "decode_rows": rows, "generated_tokens": generated}
            for n, seconds, prompt, rows, generated in slow if n > start]


def describe(run: dict[str, Any] | None) -> str | None:
    """One line for the terminal: steps, graph share, fallbacks, the loop's mean iteration."""
    if not run or not run["counters"].get("num_steps"):
        return None
    c = run["counters"]
    parts = [f"{c['num_steps']} steps"]
    if c.get("num_forward_steps", c["num_steps"]) != c["num_steps"]:
        parts.append(f"{c['num_forward_steps']} forwards")
    if "graph_step_share" in run:
        parts.append(f"{run['graph_step_share']:.0%} of forwards from CUDA graphs")
    if run.get("mixed_graph_step_share"):  # only servers with mixed graphs on report any
        parts.append(f"{run['mixed_graph_step_share']:.0%} mixed steps from piecewise graphs")
    if "cuda_graph_fallbacks" in c:
        parts.append(f"{c['cuda_graph_fallbacks']} eager decode fallbacks")
    line = "engine: " + ", ".join(parts)
    if "mean_loop_ms" in run:
        line += (f"; a busy loop iteration {run['mean_loop_ms']:.2f} ms (step "
                 f"{run.get('mean_step_ms', 0):.2f}, intake {run.get('mean_intake_ms', 0):.2f}, "
                 f"outputs {run.get('mean_send_ms', 0):.2f})")
    if "profiled_wall_over_device" in run:
        line += (f"; {c['num_profiled_forwards']} profiled forwards: their steps' wall "
                 f"{run['profiled_wall_ms_per_forward']:.2f} ms per forward, device "
                 f"{run['profiled_device_ms_per_forward']:.2f} ms "
                 f"({run['profiled_wall_over_device']:.2f}x)")
    if run.get("slow_steps"):  # the engine keeps only its latest few
        longest = max(s["seconds"] for s in run["slow_steps"])
        line += (f"; {len(run['slow_steps'])} recent steps of 0.25 s or more (the longest "
                 f"{longest:.2f} s)")
    return line
