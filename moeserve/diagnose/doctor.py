"""The doctor: rules that turn one run's figures into verdicts, each naming the knob to turn.

    diagnose(run) -> [Verdict]    every rule in RULES over one bench run object (figures.py
                                  documents its parts), most severe first

A rule is a pure function run -> Verdict | None: None when its case is absent or its figures
are missing (a run without --diagnose still gets the rules that need only the bench's figures);
those about the host's processes (client_bound, api_bound, cpu_bound_step, cpu_threads,
step_stall) live in host_rules.py, the Verdict in verdict.py. A Verdict cites the figures that
fired it in `evidence`, says the knob in words (`knob`) and, for a tuner, the same proposal as
engine config fields (`settings`: the flat names of config.py, as `engine_config_from_kwargs`
takes them; {} when no engine field is the fix). The rules:

    admission_cap     running == max_running_requests while requests wait, in >= 25% of samples
                      settings: explicit cap -> max_running_requests min(concurrency, KV fits);
                      auto cap -> request_pool concurrency (the pool set it), else
                      expected_tokens_per_request (the footprint held, when smaller), else
                      max_running_requests concurrency
    kv_capacity       min(concurrency, cap) x footprint > KV tokens, or preemptions, or KV >= 95%;
                      when the cache cannot hold the concurrency and the lengths are fixed, the
                      throughput it allows (kv_bound.py's replay) and the share reached; the
                      knob names --kv-cache-dtype fp8 while the cache is in the model's dtype
                      settings: on CUDA mem_fraction + 0.05 (up to 0.95), else
                      max_running_requests what the KV holds; {} for KV >= 95% alone (info)
    oom_steps         forward steps ran out of device memory during the run (engine/oom.py
                      recovered them: recomputed requests, a failed culprit)
                      settings: on CUDA mem_fraction - 0.05 (from above 0.5), else {}
    cuda_graphs       CUDA decode outside graphs: the capacity report's cuda_graphs starts
                      with "off"/"eager", or an engine stat whose name holds "fallback" grew
                      settings: enforce_eager False, or the capturable attention_backend /
                      moe_backend "triton" (the backend kept them off), or
                      cuda_graph_max_batch_size "auto" (batches fell outside the graphs)
    tokens_per_expert (CUDA engines) mean tokens per expert per step < 32 (expert_load, else an
                      estimate from the batch): expert GEMMs that only read weights
                      settings: max_running_requests min(concurrency, KV fits) when the cap is
                      below the client's concurrency; {} when the client's load is the limit
                      (multi-step decode repeats the weight reads: it does not help here)
    cpu_threads       (CPU engines) torch's threads > the usable cores (oversubscribed), or the
                      engine process got < 50% of a core per torch thread while the loop was
                      busy (other processes hold the cores)
                      settings: torch_threads the usable cores, or the cores it got
    gpu_power         the busy GPUs drew < 50% of their power limit at < 50% utilisation
                      settings: {} (the GPU waits on what the other verdicts name)
    client_bound      the bench's client_bound flag, or a client process above 90% of a core
                      settings: {} (--workers is the bench's)
    api_bound         an API process used >= 90% of a core
                      settings: {} (--api-servers is the server's, not the engine's)
    cpu_bound_step    (CUDA engines) the step's wall time > 1.5 x its device time, per forward,
                      over the step profile's sampled forwards (the run's engine counters:
                      num_profiled_forwards, profiled_wall/device_seconds_total); a warning
                      from 1.2 x when overlap scheduling is off (host time it would hide); for a
                      server
                      without them, the engine process used >= 90% of a core while the GPUs
                      were < 50% busy
                      settings: enforce_eager False (graphs off); {} when >= 50% of steps
                      waited for structured outputs' masks (num_grammar_waits: the knob names
                      them, no flag helps); prefill_batch_delay_steps
                      max(4, 2 x now) (>= 20% of forwards eager: mixed steps); async_scheduling
                      True (off, one decode step per plan); else num_continuous_decode_steps
                      max(2, 2 x now) with async_scheduling False (the two exclude each other)
    step_stall        a slow step of the run (the engine's latest of >= 0.25 s) whose seconds a
                      token are >= 10 x the run's: a stall (most often a kernel compiled at
                      first use); a warning when the stalls took >= 1% of the run, else info
                      settings: {} (warm up before timing)
    moe_tiles         (CUDA engines, fused MoE: triton / measured) the capacity report's MoE
                      tile configs are all untuned: the seeds' "MoE autotune left out"
                      settings: moe_tiles "tuned" when the engine was told "default"; else
                      {} (no tuned file for this device and shape: --moe-tune-budget-s, or
                      benchmarks/kernels/kernels_moe.py --tune)
    roofline          the steady step under 60% of its roofline bound (roofline.py)
                      settings: {} (the fix is in the kernels or in the other verdicts)
    communication     (several ranks) the collectives' share of the sampled step's device time
                      (parallel_rules.py), with each EP rank's share of the routed tokens
                      settings: tensor_parallel_size half of now
    w4a16_linears     (CUDA engines) projections outside the routed experts in NVFP4 / INT4,
                      weight-only GEMMs slower than bf16's (quant_rules.py)
                      settings: dequantize_linears True

NOTE: cpu_bound_step reads no gauge means. The gauges step_seconds and gpu_step_seconds are
sampled by /v1/engine, whose answer (a Ping) waits for the step in progress: a query is answered
after the step it arrives in, so long (mixed, prefill) steps are over-represented in the
step_seconds samples, while the profile samples every Nth forward whatever its length. Their
means' ratio overstated the host's share (mixtral W1 at 1,024: 178 ms against 94, while the
counters said 104 ms a step).

A step at 60% or more of its bound is not a verdict; `summary_lines` states which roof bounds
it (memory or compute) and at what share, for every run with an engine timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moeserve.diagnose import expert_load, figures
from moeserve.diagnose.bounds import kv_bound, roofline
from moeserve.diagnose.host_rules import (
    LOW_UTIL_PCT,
    api_bound,
    client_bound,
    cpu_bound_step,
    cpu_threads,
    graphs_off,
    graphs_off_settings,
    step_stall,
)
from moeserve.diagnose.parallel_rules import communication, ep_rank_load
from moeserve.diagnose.quant_rules import w4a16_linears
from moeserve.diagnose.verdict import SEVERITIES, Verdict, as_flags
from moeserve.diagnose.verdict import rounded as _r

__all__ = ["RULES", "SEVERITIES", "Verdict", "diagnose", "format_verdicts", "summary_lines"]

CAP_BINDING_SHARE = 0.25
KV_USAGE_HIGH = 0.95
MIN_TOKENS_PER_EXPERT = 32.0  # below it, expert GEMMs read weights far more than they compute
LOW_TOKENS_PER_EXPERT = 16.0  # critical below this
LOW_POWER_SHARE = 0.5
MEM_FRACTION_MAX = 0.95  # kv_capacity proposes mem_fraction up to this
ROOFLINE_TARGET = 0.6  # DESIGN.md: the target is 60% of the ceiling


def _sched(run: dict[str, Any]) -> dict[str, Any]:
    return figures.engine_section(run, "scheduler")


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
        knob, settings = _auto_cap_knob(run, cap, conc, fp)
    else:
        target = min(conc, fits) if fits else conc
        knob = (f"--max-running-requests auto, or {target} (client concurrency {conc}"
                + (f"; the KV cache fits {fits} requests of {fp:.0f} tokens)" if fits else ")"))
        settings = {"max_running_requests": target}
    how = "auto" if setting == "auto" else "explicit"
    return Verdict("admission_cap", "critical",
                   f"admission cap binding: running == max_running_requests {cap} ({how}) "
                   f"while about {ev['mean_waiting_when_capped']:.0f} requests waited, in "
                   f"{share:.0%} of {len(t)} samples; the client kept {conc} in flight", knob, ev,
                   settings)


def _auto_cap_knob(run: dict[str, Any], cap: int, conc: int, fp: float | None
                   ) -> tuple[str, dict[str, Any]]:
    """What raises an auto cap: the pool when the pool set it, else more KV or a smaller
    assumed footprint, or an explicit cap (preemption then handles the overflow). The knob
    and the one setting proposed (the first the knob names that applies)."""
    pool, assumed = _sched(run).get("request_pool"), _sched(run).get("expected_tokens_per_request")
    if cap == pool:
        return (f"--request-pool {conc} (the cap is the pool, {pool})",
                {"request_pool": conc})
    knob = "--mem-fraction (a larger KV cache raises the auto cap)"
    settings: dict[str, Any] = {"max_running_requests": conc}
    if fp and isinstance(assumed, int) and fp < assumed:
        knob += (f", --expected-tokens-per-request {int(fp)} (the rule assumed {assumed}; "
                 f"these requests hold {fp:.0f})")
        settings = {"expected_tokens_per_request": int(fp)}
    return knob + f", or --max-running-requests {conc} (preemption absorbs the overflow)", settings


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
    fp8 = _fp8_cache_words(run)
    knob = (f"--mem-fraction (a larger KV cache), {fp8}--max-model-len (a shorter context), or "
            f"--max-running-requests {fits if fits else 'lower'} (what the KV cache holds)")
    bound = kv_bound.run_kv_bound(run) if kv and need and need > kv else None
    if bound is not None:
        ev["kv_bound"] = bound
        why.append(_kv_bound_words(bound))
        knob += (": a cap at what the cache holds only stops preemption; more KV tokens are "
                 "what raises the bound")
    sev = "warning" if preemptions > 0 or (need and kv and need > kv) else "info"
    return Verdict("kv_capacity", sev, "KV cache too small for the concurrency: " + "; ".join(why),
                   knob, ev, _kv_settings(run, fits) if sev == "warning" else {})


def _fp8_cache_words(run: dict[str, Any]) -> str:
    """The float8 cache as a knob, while the cache is still in the model's dtype
    (kv_cache_dtype "auto"), with what it costs a step as measured on the H200
    (benchmarks/results/gpu_2928ff4/): a capacity lever, not a faster read."""
    if figures.engine_section(run, "cache").get("kv_cache_dtype", "auto") != "auto":
        return ""
    model = roofline.model_of(run)
    cost = ("its latent reads take about twice bf16's time a step in this build"
            if model is not None and model.mla is not None
            else "its reads take about bf16's time a step in this build")
    return (f"--kv-cache-dtype fp8 (float8 e4m3: twice a bf16 cache's tokens, values rounded to "
            f"3 mantissa bits; {cost}), ")


def _kv_bound_words(bound: dict[str, Any]) -> str:
    """The KV-limited bound in a sentence: what the cache allows, the share reached, and what
    room for every request would allow."""
    given, room = bound["with_kv_given"], bound["with_room_for_all"]
    reached = f" (this run: {bound['percent']:.0f}% of it)" if "percent" in bound else ""
    return (f"at {given['concurrent']} requests at a time the cache bounds this workload at "
            f"{given['input_tok_per_s']:,.0f} input tok/s{reached}; room for all "
            f"{room['concurrent']} would allow {room['input_tok_per_s']:,.0f}")


def _kv_settings(run: dict[str, Any], fits: int | None) -> dict[str, Any]:
    """More KV on a GPU while mem_fraction has room, else a cap the KV cache holds."""
    mem = figures.engine_section(run, "cache").get("mem_fraction")
    if figures.device_kind(run) == "cuda" and isinstance(mem, int | float) and \
            mem < MEM_FRACTION_MAX:
        return {"mem_fraction": round(min(MEM_FRACTION_MAX, mem + 0.05), 2)}
    return {"max_running_requests": fits} if fits else {}


def oom_steps(run: dict[str, Any]) -> Verdict | None:
    """Forward steps that ran out of device memory during the run (the engine recovered them:
    engine/oom.py), from the engine counter num_oom_steps."""
    _, series = figures.engine_series(run, "num_oom_steps", in_run=False)
    vals = [v for v in series if v is not None]
    steps = int(vals[-1] - vals[0]) if len(vals) >= 2 else 0
    if steps <= 0:
        return None
    mem = figures.engine_section(run, "cache").get("mem_fraction")
    settings = ({"mem_fraction": round(mem - 0.05, 2)}
                if figures.device_kind(run) == "cuda" and isinstance(mem, int | float)
                and mem > 0.5 else {})
    return Verdict("oom_steps", "critical",
                   f"{steps} forward steps ran out of device memory: their requests were "
                   "recomputed (lost work), and a request that was the largest of two such steps "
                   "failed", "--mem-fraction lower (more room beside the KV cache for a step's "
                   "activations), or --max-num-batched-tokens lower (smaller prefill steps)",
                   {"oom_steps": steps, "mem_fraction": mem}, settings)


def cuda_graphs(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) != "cuda":
        return None
    state = figures.capacity_report(run).get("cuda_graphs")
    off = graphs_off(state)
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
    settings = graphs_off_settings(state) if off else {"cuda_graph_max_batch_size": "auto"}
    return Verdict("cuda_graphs", "warning", f"decode runs outside CUDA graphs: {what}",
                   f"turn CUDA graphs on ({as_flags(settings)}), with batch sizes up to "
                   "max_running_requests", {"cuda_graphs": state, "fallbacks": fallbacks},
                   settings)


def tokens_per_expert(run: dict[str, Any]) -> Verdict | None:
    # NOTE: GPU only: a GPU's expert GEMMs at few tokens stream weights at a fraction of their
    # FLOPs; a CPU's throughput moves with torch's threads against its cores (cpu_threads)
    if figures.device_kind(run) != "cuda":
        return None
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
    knob, settings = _batch_knob(run)
    sev = "critical" if value < LOW_TOKENS_PER_EXPERT else "warning"
    return Verdict("tokens_per_expert", sev,
                   f"too few tokens per expert for efficient GEMMs: {value:.1f} per expert per "
                   f"step ({source}); below {MIN_TOKENS_PER_EXPERT:.0f} the expert GEMMs only "
                   "stream weights", knob, ev, settings)


def _batch_knob(run: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A larger decode batch: the engine's cap when it is below the client's concurrency,
    else the client's load (the engine already runs all it is sent)."""
    cap, conc = figures.max_running_cap(run), figures.client_concurrency(run)
    kv, fp = figures.kv_tokens(run), figures.request_footprint(run)
    fits = int(kv // fp) if kv and fp else None
    target = min(conc, fits) if fits else conc
    if cap is not None and cap < target:
        return (f"raise the batch: --max-running-requests {target} (the cap {cap} is below the "
                f"client's {conc} in flight)", {"max_running_requests": target})
    return (f"raise the batch: more requests in flight (--max-concurrency, now {conc}); the "
            "engine runs every request it is sent", {})


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


def moe_tiles(run: dict[str, Any]) -> Verdict | None:
    if figures.device_kind(run) != "cuda":
        return None
    cfg = figures.engine_config(run)
    tiles = figures.capacity_report(run).get("moe_configs")
    if cfg.get("moe_backend") not in ("triton", "measured") or not isinstance(tiles, dict) \
            or not tiles or any(isinstance(c, dict) and c.get("tuned") for c in tiles.values()):
        return None
    told = cfg.get("moe_tiles") == "default"
    ev = {"moe_tiles": cfg.get("moe_tiles"), "moe_backend": cfg.get("moe_backend"),
          "batch_sizes": sorted(int(n) for n in tiles), "tiles": sorted(
              {str(c.get("tiles")) for c in tiles.values() if isinstance(c, dict)})}
    why = ("the engine was told to use them (moe_tiles=default)" if told else
           "no tuned tile file exists for this device and MoE shape")
    knob = ("--moe-tiles tuned" if told else
            "--moe-tune-budget-s (tune at start-up), or benchmarks/kernels/kernels_moe.py --tune")
    return Verdict("moe_tiles", "warning",
                   f"the fused MoE runs its in-code default tiles at every batch size: {why}; "
                   "tuned tiles are what the MoE's share of the step is measured against",
                   knob, ev, {"moe_tiles": "tuned"} if told else {})


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
RULES: tuple[Rule, ...] = (admission_cap, kv_capacity, oom_steps, cuda_graphs, tokens_per_expert,
                           cpu_threads, gpu_power, client_bound, api_bound, cpu_bound_step,
                           step_stall, moe_tiles, roofline_rule, communication, w4a16_linears)


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
    er = figures.engine_run(run)
    if "profiled_wall_over_device" in er:
        lines.append(f"engine loop: {er['counters']['num_profiled_forwards']} profiled forwards, "
                     f"their steps {er['profiled_wall_ms_per_forward']:.2f} ms per forward vs "
                     f"{er['profiled_device_ms_per_forward']:.2f} ms on the device "
                     f"({er['profiled_wall_over_device']:.2f}x)")
    threads = figures.torch_threads(run)
    if figures.device_kind(run) == "cpu" and threads is not None:
        engine = figures.process_cpu(run).get("engine")
        lines.append(f"CPU: {threads} torch threads, {figures.usable_cores(run) or '?'} usable "
                     "cores" + (f", the engine process used {max(engine):.1f} cores" if engine
                                else ""))
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
    shares = ep_rank_load(run)
    if shares is not None:
        lines.append("experts by EP rank: " + ", ".join(
            f"rank {r} {s:.0%}" for r, s in enumerate(shares)) + " of the routed tokens")
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
        if v.settings:
            out.append("    settings: " + ", ".join(f"{k}={val!r}" for k, val in
                                                    v.settings.items()))
    return out
