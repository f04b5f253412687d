"""The doctor's rules about the host's processes: the bench client, the API processes, the
engine loop against its device work, torch's CPU threads against the cores. The table of every
rule, its threshold and its settings is doctor.py's docstring.

The engine loop is judged by counters, not gauges: over the step profile's sampled forwards
(every Nth, whatever its length), the wall seconds per forward of the steps that ran them
against their device seconds (the run's engine_run counters). Gauges sampled by /v1/engine are
length-biased (doctor.py's NOTE); the process-CPU test is kept for servers without the counters.
"""

from __future__ import annotations

from typing import Any

from moeserve.diagnose import figures
from moeserve.diagnose.verdict import Verdict, as_flags, rounded

BUSY_CPU = 0.9  # a process at this share of one core is saturated (Python is one thread)
LOW_UTIL_PCT = 50.0  # a GPU below this mean utilisation waits on something
STEP_OVER_GPU = 1.5  # a step's wall time over its device time, per forward
# with overlap scheduling off, host time beyond this share of the device's is time that the
# overlap would hide: the H200's qwen3 W1 at 1,024 with graphs on and overlap off ran 1.35x
# (36.2 ms a forward against 26.9), and overlap on took the run's step from 44 to 39 ms
NOT_OVERLAPPED = 1.2
MIN_PROFILED_FORWARDS = 3  # fewer profiled forwards in the run: the process-CPU fallback
EAGER_SHARE_HIGH = 0.2  # graphs on, yet this share of forwards ran eagerly: mixed steps dominate
GRAMMAR_SHARE_HIGH = 0.5  # this share of steps waited for their grammars' masks
STARVED_SHARE = 0.5  # a CPU engine that gets less than this share of a core per torch thread
BUSY_LOOP_SHARE = 0.5  # ... while its loop had work at least this share of the run
# a slow step's seconds a token at this multiple of the run's is a stall, not work (the first
# server on a fresh H200 paid 1.5 s in one decode step of a run whose steps took 29 ms:
# benchmarks/results/gpu_e6ddc73/call4); a warning when the stalls took this share of the run
STALL_RATIO = 10.0
STALL_SHARE = 0.01


def client_bound(run: dict[str, Any]) -> Verdict | None:
    fractions = [c.get("cpu_fraction", 0.0) for c in run.get("client") or []]
    if not run.get("client_bound") and not any(f > BUSY_CPU for f in fractions):
        return None
    n = len(fractions) or 1
    return Verdict("client_bound", "critical",
                   f"client-bound: a bench client process used {max(fractions, default=0):.0%} "
                   f"of a core (> {BUSY_CPU:.0%}); the figures measure the client",
                   f"--workers {2 * n} (bench client processes; now {n})",
                   {"client_cpu_fractions": [rounded(f) for f in fractions], "workers": n})


def api_bound(run: dict[str, Any]) -> Verdict | None:
    n = figures.server_settings(run).get("api_servers") or 1
    per_proc = figures.process_cpu(run).get("api")
    if per_proc:
        busiest, source = max(per_proc), "psutil, per API process"
    elif isinstance(run.get("server_api_cpu_fraction"), int | float):
        busiest, source = run["server_api_cpu_fraction"] / n, "/metrics CPU seconds / processes"
    else:
        return None
    if busiest < BUSY_CPU:
        return None
    return Verdict("api_bound", "critical",
                   f"API-bound: an API server process used {busiest:.0%} of a core ({n} API "
                   "process(es)); streaming, not the engine, sets the pace",
                   f"--api-servers {2 * n} (serve flag; now {n})",
                   {"api_cpu_fraction": rounded(busiest), "api_servers": n, "source": source,
                    "per_process": [rounded(p) for p in per_proc or []]})


def cpu_bound_step(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) != "cuda":
        return None
    c = figures.run_counters(run)
    n = c.get("num_profiled_forwards")
    if isinstance(n, int | float) and n >= MIN_PROFILED_FORWARDS and \
            c.get("profiled_device_seconds_total", 0) > 0:
        return _cpu_bound_by_counters(run, c)
    return _cpu_bound_by_process_cpu(run)


def _cpu_bound_by_counters(run: dict[str, Any], c: dict[str, Any]) -> Verdict | None:
    """Over the run's profiled forwards (every Nth, whatever its length): the wall seconds per
    forward of the steps that ran them against their device seconds."""
    n = c["num_profiled_forwards"]
    wall, device = c["profiled_wall_seconds_total"] / n, c["profiled_device_seconds_total"] / n
    ratio = wall / device
    async_on = bool(figures.engine_config(run).get("async_scheduling"))
    if ratio <= (STEP_OVER_GPU if async_on else NOT_OVERLAPPED):
        return None
    critical = ratio > STEP_OVER_GPU
    knob, settings = _host_knob(run)
    ev: dict[str, Any] = {
        "source": "engine_run counters (the step profile's forwards)",
        "num_profiled_forwards": n, "wall_ms_per_forward": rounded(wall * 1e3),
        "device_ms_per_forward": rounded(device * 1e3), "wall_over_device": rounded(ratio),
        "threshold": STEP_OVER_GPU,
        "async_scheduling": async_on}
    where = ""
    forwards = c.get("num_forward_steps")
    if forwards:  # the whole run's loop, per forward (every step, not only the profiled ones)
        ev |= {"num_steps": c.get("num_steps"), "num_forward_steps": forwards}
        for key in ("step", "loop"):
            total = c.get(f"busy_{key}_seconds_total")
            if total is not None:
                ev[f"run_{key}_ms_per_forward"] = rounded(1e3 * total / forwards)
        if "run_loop_ms_per_forward" in ev:
            where = (f"; over all {forwards} forwards the loop took "
                     f"{ev['run_loop_ms_per_forward']} ms per forward")
    if not critical:  # overlap off, and the host's part of the step is what it would hide
        ev["threshold"] = NOT_OVERLAPPED
        return Verdict("cpu_bound_step", "warning",
                       f"host time not overlapped: over {n} profiled forwards a step took "
                       f"{wall * 1e3:.2f} ms per forward against {device * 1e3:.2f} ms of device "
                       f"work ({ratio:.2f}x > {NOT_OVERLAPPED}) with overlap scheduling off: "
                       f"{(wall - device) * 1e3:.2f} ms of host work per forward could run "
                       f"while the device works{where}", knob, ev, settings)
    return Verdict("cpu_bound_step", "critical",
                   f"CPU-bound step loop: over {n} profiled forwards a step took {wall * 1e3:.2f} "
                   f"ms per forward against {device * 1e3:.2f} ms of device work ({ratio:.2f}x > "
                   f"{STEP_OVER_GPU}){where}", knob, ev, settings)


def _cpu_bound_by_process_cpu(run: dict[str, Any]) -> Verdict | None:
    """For a server without the step profile's counters: the engine process saturated a core
    while the GPUs were mostly idle."""
    w = figures.steady_window(run)
    if w is None or w.mean_running <= 0:
        return None
    engine = figures.process_cpu(run).get("engine")
    gpus = figures.busy_gpus(figures.gpu_figures(run))
    util = figures.mean([g.mean_util_pct for g in gpus])
    if not engine or util is None or max(engine) < BUSY_CPU or util >= LOW_UTIL_PCT:
        return None
    knob, settings = _host_knob(run)
    return Verdict("cpu_bound_step", "critical",
                   f"CPU-bound step loop: the engine process used {max(engine):.0%} of a core "
                   f"while the GPU was {util:.0f}% busy, with {w.mean_running:.0f} requests "
                   "running", knob,
                   {"source": "process CPU (psutil) and GPU utilisation (NVML): the engine "
                    "reports no step-profile counters",
                    "engine_cpu_fraction": rounded(max(engine)), "gpu_util_pct": rounded(util, 1),
                    "mean_running": rounded(w.mean_running, 1),
                    "async_scheduling": bool(figures.engine_config(run).get("async_scheduling"))},
                   settings)


def _host_knob(run: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """What takes host work off the step, in the order it pays: CUDA graphs (when they are off),
    the structured outputs' masks when most steps waited for them (no flag: words only), fewer
    eager mixed steps, overlap scheduling, then several decode steps per plan."""
    cfg, sched = figures.engine_config(run), figures.engine_section(run, "scheduler")
    steps = sched.get("num_continuous_decode_steps")
    steps = steps if isinstance(steps, int) and steps >= 1 else 1
    state = figures.capacity_report(run).get("cuda_graphs")
    if cfg.get("enforce_eager") or graphs_off(state):
        settings = graphs_off_settings(state if isinstance(state, str) else "off: enforce_eager")
        return (f"{as_flags(settings)}: CUDA graphs are off, so every decode step pays the "
                "host's kernel launches", settings)
    grammar = _grammar_step_share(run)
    if grammar is not None and grammar >= GRAMMAR_SHARE_HIGH:
        return (f"{grammar:.0%} of steps held a structured output's grammar: each waited for the "
                "step before to build its token masks on the host (num_grammar_waits; on a "
                "thread of their own, beside the loop's other host work), and such "
                "steps decode one token a plan (--num-continuous-decode-steps skips them): "
                "fewer or simpler grammars per step, or structured requests on a server of "
                "their own; no engine flag takes this host work off the step", {})
    eager = _eager_forward_share(run)
    if eager is not None and eager >= EAGER_SHARE_HIGH:
        delay = sched.get("prefill_batch_delay_steps")
        delay = max(4, 2 * delay) if isinstance(delay, int) else 4
        return (f"{eager:.0%} of forwards ran eagerly (a step that mixes prefill with decode has "
                "no CUDA graph and pays the host's kernel launches): gather new prompts into "
                f"fewer prefill steps (--prefill-batch-delay-steps {delay}), or "
                "--num-continuous-decode-steps", {"prefill_batch_delay_steps": delay})
    if not cfg.get("async_scheduling") and steps == 1:
        return ("--async-scheduling (plan step N+1 while the GPU runs step N), CUDA graphs",
                {"async_scheduling": True})
    more = max(2, 2 * steps)
    return (f"CUDA graphs and --num-continuous-decode-steps {more} (less Python per token; "
            "it runs without --async-scheduling)",
            {"num_continuous_decode_steps": more, "async_scheduling": False})


def _grammar_step_share(run: dict[str, Any]) -> float | None:
    """Share of the run's steps that waited for the step before for their grammars' masks
    (engine counters num_grammar_waits / num_steps); None without them."""
    c = figures.run_counters(run)
    waits, steps = c.get("num_grammar_waits"), c.get("num_steps")
    if not isinstance(waits, int | float) or not isinstance(steps, int | float) or steps <= 0:
        return None
    return waits / steps


def graphs_off(state: Any) -> bool:
    """The capacity report's cuda_graphs line says they are off."""
    return isinstance(state, str) and state.strip().lower().startswith(
        ("off", "eager", "disabled"))


def graphs_off_settings(state: str) -> dict[str, Any]:
    """What turns the graphs on, from the capacity report's reason they are off."""
    why = state.lower()
    if "attention backend" in why:
        return {"attention_backend": "triton"}
    if "moe backend" in why:
        return {"moe_backend": "triton"}
    return {"enforce_eager": False}


def _eager_forward_share(run: dict[str, Any]) -> float | None:
    """Share of the run's model forwards that replayed no CUDA graph: the run's counters
    (graph_step_share, per forward), else the timeline's cumulative num_steps and
    num_graph_steps; None when the engine does not report graph steps."""
    share = figures.engine_run(run).get("graph_step_share")
    if isinstance(share, int | float):
        return max(0.0, 1.0 - share)
    _, steps = figures.engine_series(run, "num_steps", in_run=False)
    _, graphed = figures.engine_series(run, "num_graph_steps", in_run=False)
    pairs = [(a, b) for a, b in zip(steps, graphed) if a is not None and b is not None]
    if len(pairs) < 2 or pairs[-1][0] <= pairs[0][0]:
        return None
    d_steps, d_graph = pairs[-1][0] - pairs[0][0], pairs[-1][1] - pairs[0][1]
    return max(0.0, 1.0 - d_graph / d_steps)


def cpu_threads(run: dict[str, Any]) -> Verdict | None:
    """A CPU engine: torch's threads against the cores it may use, and the cores it got."""
    if figures.device_kind(run) != "cpu":
        return None
    threads, cores = figures.torch_threads(run), figures.usable_cores(run)
    if threads is None:
        return None
    ev: dict[str, Any] = {"torch_threads": threads, "usable_cores": cores}
    if cores is not None and threads > cores:
        return Verdict("cpu_threads", "critical",
                       f"torch runs {threads} CPU threads on {cores} usable cores: the threads "
                       "contend for the cores and every op waits for the slowest one",
                       f"--torch-threads {cores} (the usable cores)",
                       ev | {"source": "capacity report"}, {"torch_threads": cores})
    engine, busy = figures.process_cpu(run).get("engine"), _busy_share(run)
    if not engine or busy is None or busy < BUSY_LOOP_SHARE:
        return None
    got = max(engine) / busy  # cores while the loop had work
    if got >= STARVED_SHARE * threads:
        return None
    fit = max(1, round(got))
    ev |= {"engine_cores_while_busy": rounded(got, 2), "engine_cpu_fraction": rounded(max(engine)),
           "busy_share": rounded(busy), "starved_below": STARVED_SHARE * threads,
           "source": "process CPU (psutil) over the engine loop's busy share"}
    knob = (f"--torch-threads {fit} (what it gets), or free the cores" if fit < threads
            else "free the cores (stop the other processes, or pin them elsewhere)")
    return Verdict("cpu_threads", "warning",
                   f"the engine process got {got:.1f} cores for its {threads} torch threads "
                   f"({cores if cores is not None else 'unknown'} usable) while its loop was "
                   f"busy {busy:.0%} of the run: other processes hold the cores (or its ops are "
                   "too small to spread over the threads)", knob, ev,
                   {"torch_threads": fit} if fit < threads else {})


def _busy_share(run: dict[str, Any]) -> float | None:
    """Share of the run the engine loop had work: the run's counters, else the share of
    timeline samples with requests running."""
    share = figures.engine_run(run).get("busy_share")
    if isinstance(share, int | float):
        return min(1.0, float(share))
    _, running = figures.engine_series(run, "num_running")
    vals = [r for r in running if r is not None]
    return sum(1 for r in vals if r > 0) / len(vals) if vals else None


def step_stall(run: dict[str, Any]) -> Verdict | None:
    """The run's slow steps (engine_run's slow_steps: the engine's latest steps of 0.25 s or
    more) whose seconds a token are STALL_RATIO or more times the run's (busy step seconds over
    prompt + generated tokens): time their tokens do not explain."""
    c, slow = figures.run_counters(run), figures.slow_steps(run)
    step_s = c.get("busy_step_seconds_total")
    tokens = (c.get("num_prompt_tokens") or 0) + (c.get("num_generated_tokens") or 0)
    if not slow or not step_s or tokens <= 0:
        return None
    per_token = step_s / tokens
    stalls = [s for s in slow if s["seconds"] / max(1, s["prompt_tokens"] + s["generated_tokens"])
              >= STALL_RATIO * per_token]
    if not stalls:
        return None
    worst = max(stalls, key=lambda s: s["seconds"])
    stalled = sum(s["seconds"] for s in stalls)
    share = stalled / run["duration"] if run.get("duration") else None
    severity = "warning" if share is None or share >= STALL_SHARE else "info"
    return Verdict("step_stall", severity,
                   f"{len(stalls)} step(s) took far longer than their tokens explain: the "
                   f"longest {worst['seconds']:.2f} s (step {worst['step']} of the run: "
                   f"{worst['prompt_tokens']} prompt tokens, {worst['decode_rows']} decode rows)"
                   f" against {1e3 * per_token:.3f} ms a token over the run; "
                   f"{stalled:.2f} s in all" + (f", {share:.1%} of the run" if share else ""),
                   "most often a kernel compiled at its first use (a shape the start-up warm-up "
                   "did not reach): a second run on the same server, or on the same machine "
                   "(Triton's cache), does not pay it, so warm up before timing; else a host "
                   "pause (swap, another process)",
                   {"slow_steps": stalls, "seconds_per_token": rounded(per_token, 6),
                    "stalled_seconds": rounded(stalled, 3),
                    "share_of_run": None if share is None else rounded(share, 4)})
