"""The doctor: rules that turn one run's figures into verdicts, each naming the knob to turn.

    diagnose(run) -> [Verdict]    every rule in RULES over one bench run object (figures.py
                                  documents its parts), most severe first

A rule is a pure function run -> Verdict | None: None when its case is absent or its figures
are missing (a run without --diagnose still gets the rules that need only the bench's figures).
A Verdict cites the figures that fired it in `evidence`. The rules:

    admission_cap     running == max_running_requests while requests wait, in >= 25% of samples
    kv_capacity       min(concurrency, cap) x footprint > KV tokens, or preemptions, or KV >= 95%
    cuda_graphs       CUDA decode outside graphs: the capacity report's cuda_graphs starts
                      with "off"/"eager", or an engine stat whose name holds "fallback" grew
    tokens_per_expert mean tokens per expert per step < 32 (expert_load, else an estimate from
                      the batch): expert GEMMs that only read weights
    gpu_power         the busy GPUs drew < 50% of their power limit at < 50% utilisation
    client_bound      the bench's client_bound flag, or a client process above 90% of a core
    api_bound         an API process used >= 90% of a core
    cpu_bound_step    the engine process used >= 90% of a core while the GPUs were < 50% busy
                      (or step_seconds > 1.5 x gpu_step_seconds, when the engine's stats
                      carry that GPU time per step)
    roofline          the steady step under 60% of its roofline bound (roofline.py)

A step at 60% or more of its bound is not a verdict; `summary_lines` states which roof bounds
it (memory or compute) and at what share, for every run with an engine timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from moeserve.diagnose import expert_load, figures, roofline

SEVERITIES = ("critical", "warning", "info")
CAP_BINDING_SHARE = 0.25
KV_USAGE_HIGH = 0.95
MIN_TOKENS_PER_EXPERT = 32.0  # below it, expert GEMMs read weights far more than they compute
LOW_TOKENS_PER_EXPERT = 16.0  # critical below this
LOW_POWER_SHARE = 0.5
LOW_UTIL_PCT = 50.0
BUSY_CPU = 0.9  # a process at this share of one core is saturated (Python is one thread)
STEP_OVER_GPU = 1.5
EAGER_SHARE_HIGH = 0.2  # graphs on, yet this share of steps ran eagerly: mixed steps dominate
ROOFLINE_TARGET = 0.6  # DESIGN.md: the target is 60% of the ceiling


@dataclass(frozen=True, slots=True)
class Verdict:
    rule: str
    severity: str  # one of SEVERITIES
    message: str
    knob: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"verdict severity must be one of {SEVERITIES}, "
                             f"got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(d["rule"], d["severity"], d["message"], d["knob"], dict(d.get("evidence", {})))


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def _sched(run: dict[str, Any]) -> dict[str, Any]:
    s = figures.engine_config(run).get("scheduler")
    return s if isinstance(s, dict) else {}


def admission_cap(run: dict[str, Any]) -> Verdict | None:
    cap = figures.max_running_cap(run)
    t, running = figures.engine_series(run, "num_running")
    _, waiting = figures.engine_series(run, "num_waiting")
    if cap is None or not t or not waiting:
        return None
    hit = [i for i in range(len(t))
           if running[i] is not None and running[i] >= cap and (waiting[i] or 0) > 0]
    share = len(hit) / len(t)
    if share < CAP_BINDING_SHARE:
        return None
    setting = _sched(run).get("max_running_requests", "unknown")
    conc, kv, fp = figures.client_concurrency(run), figures.kv_tokens(run), \
        figures.request_footprint(run)
    fits = int(kv // fp) if kv and fp else None
    ev = {"max_running_requests": cap, "setting": setting, "share_of_samples": _r(share),
          "samples": len(t), "mean_waiting_when_capped": _r(figures.mean([waiting[i] for i in hit]),
                                                             1),
          "client_concurrency": conc, "kv_tokens": kv, "request_footprint": _r(fp, 1),
          "requests_kv_fits": fits}
    if setting == "auto":
        knob = _auto_cap_knob(run, cap, conc, fp)
    else:
        target = min(conc, fits) if fits else conc
        knob = (f"--max-running-requests auto, or {target} (client concurrency {conc}"
                + (f"; the KV cache fits {fits} requests of {fp:.0f} tokens)" if fits else ")"))
    how = "auto" if setting == "auto" else "explicit"
    return Verdict("admission_cap", "critical",
                   f"admission cap binding: running == max_running_requests {cap} ({how}) "
                   f"while about {ev['mean_waiting_when_capped']:.0f} requests waited, in "
                   f"{share:.0%} of {len(t)} samples; the client kept {conc} in flight", knob, ev)


def _auto_cap_knob(run: dict[str, Any], cap: int, conc: int, fp: float | None) -> str:
    """What raises an auto cap: the pool when the pool set it, else more KV or a smaller
    assumed footprint, or an explicit cap (preemption then handles the overflow)."""
    pool, assumed = _sched(run).get("request_pool"), _sched(run).get("expected_tokens_per_request")
    if cap == pool:
        return f"--request-pool (the cap is the pool, {pool})"
    knob = "--mem-fraction (a larger KV cache raises the auto cap)"
    if fp and isinstance(assumed, int) and fp < assumed:
        knob += (f", --expected-tokens-per-request {int(fp)} (the rule assumed {assumed}; "
                 f"these requests hold {fp:.0f})")
    return knob + f", or --max-running-requests {conc} (preemption absorbs the overflow)"


def kv_capacity(run: dict[str, Any]) -> Verdict | None:
    kv, fp, cap = figures.kv_tokens(run), figures.request_footprint(run), \
        figures.max_running_cap(run)
    conc = figures.client_concurrency(run)
    conc_at_engine = min(conc, cap) if cap else conc
    need = conc_at_engine * fp if fp else None
    _, pre = figures.engine_series(run, "num_preemptions", in_run=False)
    pre_vals = [p for p in pre if p is not None]
    preemptions = int(pre_vals[-1] - pre_vals[0]) if len(pre_vals) >= 2 else 0
    _, usage = figures.engine_series(run, "kv_usage")
    usage_max = max((u for u in usage if u is not None), default=None)
    why = []
    if kv and need and need > kv:
        why.append(f"{conc_at_engine} requests x {fp:.0f} tokens = {need:,.0f} > {kv:,} KV tokens")
    if preemptions > 0:
        why.append(f"{preemptions} preemptions during the run")
    if usage_max is not None and usage_max >= KV_USAGE_HIGH:
        why.append(f"KV usage reached {usage_max:.0%}")
    if not why:
        return None
    ev = {"kv_tokens": kv, "request_footprint": _r(fp, 1), "concurrency_at_engine": conc_at_engine,
          "tokens_needed": _r(need, 0), "preemptions": preemptions, "kv_usage_max": _r(usage_max)}
    fits = int(kv // fp) if kv and fp else None
    knob = ("--mem-fraction (a larger KV cache), --max-model-len (a shorter context), or "
            f"--max-running-requests {fits if fits else 'lower'} (what the KV cache holds)")
    sev = "warning" if preemptions > 0 or (need and kv and need > kv) else "info"
    return Verdict("kv_capacity", sev, "KV cache too small for the concurrency: " + "; ".join(why),
                   knob, ev)


def cuda_graphs(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) != "cuda":
        return None
    state = figures.capacity_report(run).get("cuda_graphs")
    off = isinstance(state, str) and state.strip().lower().startswith(("off", "eager", "disabled"))
    tl = figures.diagnostics(run).get("engine_timeline") or {}
    fallbacks = {}
    for key in (tl.get("stats") or {}):
        if "fallback" in key:
            vals = [v for v in figures.engine_series(run, key, in_run=False)[1] if v is not None]
            if len(vals) >= 2 and vals[-1] > vals[0]:
                fallbacks[key] = vals[-1] - vals[0]
    if not off and not fallbacks:
        return None
    what = (f"the capacity report says CUDA graphs are {state!r}" if off else
            "decode batches fell outside the captured graphs: " +
            ", ".join(f"{k} +{v}" for k, v in fallbacks.items()))
    return Verdict("cuda_graphs", "warning", f"decode runs outside CUDA graphs: {what}",
                   "turn CUDA graphs on, with batch sizes up to max_running_requests",
                   {"cuda_graphs": state, "fallbacks": fallbacks})


def tokens_per_expert(run: dict[str, Any]) -> Verdict | None:
    summary = expert_load.summarize(expert_load.of_run(run))
    if summary is not None:
        value, source = summary.mean_tokens_per_expert_per_step, "expert_load counters"
        ev: dict[str, Any] = summary.to_dict()
    else:
        model, w = roofline.model_of(run), figures.steady_window(run)
        if model is None or not model.num_experts or w is None or w.tokens_per_step is None:
            return None
        value = w.tokens_per_step * model.num_experts_per_tok / model.num_experts
        source = (f"estimate: {w.tokens_per_step:.1f} tokens per step x top-"
                  f"{model.num_experts_per_tok} / {model.num_experts} experts")
        ev = {"tokens_per_step": _r(w.tokens_per_step, 1), "top_k": model.num_experts_per_tok,
              "num_experts": model.num_experts}
    if value >= MIN_TOKENS_PER_EXPERT:
        return None
    ev.update({"mean_tokens_per_expert_per_step": _r(value, 2), "source": source,
               "threshold": MIN_TOKENS_PER_EXPERT})
    steps = figures.engine_config(run).get("num_continuous_decode_steps")
    knob = ("raise the batch: --max-concurrency and --max-running-requests; or "
            f"--num-continuous-decode-steps{f' (now {steps})' if steps is not None else ''}")
    sev = "critical" if value < LOW_TOKENS_PER_EXPERT else "warning"
    return Verdict("tokens_per_expert", sev,
                   f"too few tokens per expert for efficient GEMMs: {value:.1f} per expert per "
                   f"step ({source}); below {MIN_TOKENS_PER_EXPERT:.0f} the expert GEMMs only "
                   "stream weights", knob, ev)


def gpu_power(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) == "cpu":  # the host's GPUs are not the engine's
        return None
    gpus = [g for g in figures.busy_gpus(figures.gpu_figures(run))
            if g.power_limit_w and g.mean_power_w is not None and g.mean_util_pct is not None]
    if not gpus:
        return None
    power = sum(g.mean_power_w for g in gpus) / len(gpus)
    limit = sum(g.power_limit_w for g in gpus) / len(gpus)
    util = sum(g.mean_util_pct for g in gpus) / len(gpus)
    if power >= LOW_POWER_SHARE * limit or util >= LOW_UTIL_PCT:
        return None
    ev = {"gpus": [g.index for g in gpus], "mean_power_w": _r(power, 1),
          "power_limit_w": _r(limit, 1), "mean_util_pct": _r(util, 1),
          "mean_sm_clock_mhz": _r(figures.mean([g.mean_sm_clock_mhz for g in gpus]), 0)}
    return Verdict("gpu_power", "warning",
                   f"GPU power far under its limit: {power:.0f} of {limit:.0f} W at {util:.0f}% "
                   "utilisation; the GPU waits on something else (see the other verdicts)",
                   "more work per step: raise --max-concurrency / --max-running-requests; "
                   "then CUDA graphs, async scheduling, the client and API processes", ev)


def client_bound(run: dict[str, Any]) -> Verdict | None:
    fractions = [c.get("cpu_fraction", 0.0) for c in run.get("client") or []]
    if not run.get("client_bound") and not any(f > BUSY_CPU for f in fractions):
        return None
    n = len(fractions) or 1
    return Verdict("client_bound", "critical",
                   f"client-bound: a bench client process used {max(fractions, default=0):.0%} "
                   f"of a core (> {BUSY_CPU:.0%}); the figures measure the client",
                   f"--workers {2 * n} (bench client processes; now {n})",
                   {"client_cpu_fractions": [_r(f) for f in fractions], "workers": n})


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
                   {"api_cpu_fraction": _r(busiest), "api_servers": n, "source": source,
                    "per_process": [_r(p) for p in per_proc or []]})


def cpu_bound_step(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) != "cuda":
        return None
    w = figures.steady_window(run)
    if w is None or w.mean_running <= 0:
        return None
    async_on = bool(figures.engine_config(run).get("async_scheduling"))
    knob = ("CUDA graphs and --num-continuous-decode-steps (less Python per token)" if async_on
            else "--async-scheduling (plan step N+1 while the GPU runs step N), CUDA graphs")
    eager = _eager_step_share(run)
    if eager is not None and eager >= EAGER_SHARE_HIGH:
        knob = (f"{eager:.0%} of steps ran eagerly (a step that mixes prefill with decode has no "
                "CUDA graph and pays the host's kernel launches): gather new prompts into fewer "
                "prefill steps (--prefill-batch-delay-steps), or --num-continuous-decode-steps")
    _, step = figures.engine_series(run, "step_seconds")
    _, gpu_step = figures.engine_series(run, "gpu_step_seconds")
    step_m, gpu_m = figures.mean(step), figures.mean(gpu_step)
    loop_m = figures.mean(figures.engine_series(run, "loop_seconds")[1])
    if step_m and gpu_m and step_m > STEP_OVER_GPU * gpu_m:
        ev = {"step_ms": _r(step_m * 1e3), "gpu_step_ms": _r(gpu_m * 1e3),
              "async_scheduling": async_on}
        where = ""
        if loop_m:  # the engine reports its loop: intake and outputs beside the step
            ev |= {f"{k}_ms": _r(figures.mean(figures.engine_series(run, f"{k}_seconds")[1])
                                 * 1e3) for k in ("loop", "intake", "send")}
            where = (f"; the whole loop iteration {ev['loop_ms']} ms (intake {ev['intake_ms']}, "
                     f"outputs {ev['send_ms']})")
        return Verdict("cpu_bound_step", "critical",
                       f"CPU-bound step loop: a step takes {step_m * 1e3:.2f} ms, its GPU work "
                       f"{gpu_m * 1e3:.2f} ms{where}", knob, ev)
    engine = figures.process_cpu(run).get("engine")
    gpus = figures.busy_gpus(figures.gpu_figures(run))
    util = figures.mean([g.mean_util_pct for g in gpus])
    if not engine or util is None or max(engine) < BUSY_CPU or util >= LOW_UTIL_PCT:
        return None
    return Verdict("cpu_bound_step", "critical",
                   f"CPU-bound step loop: the engine process used {max(engine):.0%} of a core "
                   f"while the GPU was {util:.0f}% busy, with {w.mean_running:.0f} requests "
                   "running", knob,
                   {"engine_cpu_fraction": _r(max(engine)), "gpu_util_pct": _r(util, 1),
                    "mean_running": _r(w.mean_running, 1), "async_scheduling": async_on})


def _eager_step_share(run: dict[str, Any]) -> float | None:
    """Share of the run's engine steps that replayed no CUDA graph (stats num_steps and
    num_graph_steps, cumulative); None when the engine does not report graph steps."""
    _, steps = figures.engine_series(run, "num_steps", in_run=False)
    _, graphed = figures.engine_series(run, "num_graph_steps", in_run=False)
    pairs = [(a, b) for a, b in zip(steps, graphed) if a is not None and b is not None]
    if len(pairs) < 2 or pairs[-1][0] <= pairs[0][0]:
        return None
    d_steps, d_graph = pairs[-1][0] - pairs[0][0], pairs[-1][1] - pairs[0][1]
    return max(0.0, 1.0 - d_graph / d_steps)


def roofline_rule(run: dict[str, Any]) -> Verdict | None:
    res, _ = roofline.analyse(run)
    if res is None or res.fraction >= ROOFLINE_TARGET:
        return None
    ev = res.evidence()
    if res.kind == "memory":
        what = (f"{ev['gb_per_step']} GB per step at {ev['ceiling_tb_per_s']} TB/s; achieved "
                f"{ev['achieved_tb_per_s']} TB/s")
        knob = ("the step spends its time outside the weight and KV reads: CUDA graphs, "
                "--moe-backend, --async-scheduling (see the other verdicts)")
    else:
        what = (f"{ev['gflop_per_step']} GFLOP per step at {ev['ceiling_tflop_per_s']} TFLOP/s; "
                f"achieved {ev['achieved_tflop_per_s']} TFLOP/s")
        knob = "the GEMMs run under the FLOP ceiling: --moe-backend, tuned MoE kernel configs"
    return Verdict("roofline", "warning",
                   f"{res.kind}-bound step at {ev['percent_of_roofline']}% of its roofline: "
                   f"{ev['step_ms_observed']} ms per step at batch {ev['batch']} "
                   f"({ev['tokens_per_step']} tokens) vs a bound of {ev['step_ms_bound']} ms "
                   f"({what}); engine {ev['engine_tok_per_s_observed']:,.0f} tok/s vs "
                   f"{ev['engine_tok_per_s_bound']:,.0f} at the bound", knob, ev)


Rule = Callable[[dict[str, Any]], Verdict | None]
RULES: tuple[Rule, ...] = (admission_cap, kv_capacity, cuda_graphs, tokens_per_expert, gpu_power,
                           client_bound, api_bound, cpu_bound_step, roofline_rule)


def diagnose(run: dict[str, Any]) -> list[Verdict]:
    """Every rule's verdict on one run, most severe first. ValueError for a run that is not a
    bench result object, or whose diagnostics are malformed (the message names the field)."""
    if not isinstance(run, dict) or "duration" not in run:
        raise ValueError("not a bench result: expected a JSON object with 'duration' (a line "
                         "of `moeserve bench --output-json`)")
    verdicts = [v for v in (rule(run) for rule in RULES) if v is not None]
    return sorted(verdicts, key=lambda v: SEVERITIES.index(v.severity))


def summary_lines(run: dict[str, Any]) -> list[str]:
    """The run's headline figures in words (printed before its verdicts)."""
    conc = run.get("max_concurrency")
    lines = [f"output {run.get('output_throughput', 0):,.0f} tok/s, median TPOT "
             f"{run.get('median_tpot_ms', 0):.1f} ms, {run.get('completed', 0)} requests in "
             f"{run.get('duration', 0):.1f} s at "
             + (f"concurrency {conc}" if conc is not None else "no concurrency cap")]
    w = figures.steady_window(run)
    if w is not None:
        step = f", {w.step_seconds * 1e3:.2f} ms per step" if w.step_seconds else ""
        lines.append(f"engine: {w.mean_running:.0f} running, {w.mean_waiting:.0f} waiting "
                     f"(steady window {w.t0:.1f}-{w.t1:.1f} s){step}")
    res, why = roofline.analyse(run)
    if res is not None:
        ev = res.evidence()
        lines.append(f"roofline: {ev['bound']}-bound, {ev['percent_of_roofline']}% "
                     f"({ev['step_ms_observed']} ms per step vs {ev['step_ms_bound']} ms; "
                     f"{ev['achieved_tb_per_s']} TB/s, {ev['achieved_tflop_per_s']} TFLOP/s)")
    elif figures.diagnostics(run):
        lines.append(f"roofline: not computed ({why})")
    for g in figures.busy_gpus(figures.gpu_figures(run)):
        lines.append(f"GPU {g.index}: {g.mean_power_w or 0:.0f} of {g.power_limit_w or 0:.0f} W, "
                     f"{g.mean_util_pct or 0:.0f}% busy, SM {g.mean_sm_clock_mhz or 0:.0f} MHz")
    summary = expert_load.summarize(expert_load.of_run(run))
    if summary is not None:
        lines.append(f"experts: {summary.mean_tokens_per_expert_per_step:.1f} tokens per expert "
                     f"per step, imbalance {summary.mean_imbalance:.2f} (worst layer "
                     f"{summary.max_imbalance:.2f})")
    if not figures.diagnostics(run):
        lines.append("no diagnostics in this run (`moeserve bench --diagnose` records them): "
                     "only the rules that need the bench's own figures ran")
    return lines


def format_verdicts(verdicts: list[Verdict]) -> list[str]:
    """Plain text, one verdict per line plus its knob."""
    if not verdicts:
        return ["no verdict: no rule fired"]
    out = []
    for v in verdicts:
        out += [f"[{v.severity}] {v.rule}: {v.message}", f"    knob: {v.knob}"]
    return out
