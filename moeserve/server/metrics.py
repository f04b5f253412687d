"""Prometheus metrics of the API process (GET /metrics).

Two sources, one registry per app:
- measured here, per request, from the moment its HTTP body is parsed: TTFT, time per output
  token, end-to-end latency (histograms), tokens and requests by finish reason, rejections by
  reason (400 / 429 / 503), client disconnects, connections refused at accept and timed out
  (process/connections.py), and a tokens-per-second gauge over the last `RATE_WINDOW_S` seconds;
- read from the engine at scrape time (the client's latest stats snapshot): running, waiting, KV
  usage, in flight, and the engine's own cumulative counters (steps, preemptions, prefix hits).

Per streamed event the cost is one `RequestTimer.on_tokens` call (a few float ops and one
counter increment), so metrics stay cheap at tens of thousands of events per second.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from moeserve import envs

if TYPE_CHECKING:
    from moeserve.engine.process.async_client import AsyncEngineClient

RATE_WINDOW_S = 5
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class RateMeter:
    """Events per second over the last `window` whole seconds, in one-second bins."""

    def __init__(self, window: int = RATE_WINDOW_S) -> None:
        self.window = window
        self._bins = [0] * (window + 1)
        self._bin_second = [0] * (window + 1)

    def add(self, count: int, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        i = second % len(self._bins)
        if self._bin_second[i] != second:
            self._bin_second[i], self._bins[i] = second, 0
        self._bins[i] += count

    def rate(self, now: float | None = None) -> float:
        """Sum of the `window` complete seconds before the current one, per second."""
        second = int(time.monotonic() if now is None else now)
        total = sum(n for n, s in zip(self._bins, self._bin_second)
                    if second - self.window <= s < second)
        return total / self.window


class _EngineCollector:
    """Reads the client's stats snapshot at scrape time."""

    def __init__(self, client: AsyncEngineClient, meter: RateMeter) -> None:
        self.client = client
        self.meter = meter

    def collect(self) -> Iterator[Metric]:
        s = self.client.stats
        gauges = [
            ("moeserve_num_requests_running", "Requests running in the engine", s.num_running),
            ("moeserve_num_requests_structured", "Requests held to a grammar (structured "
             "outputs)", s.num_structured),
            ("moeserve_num_requests_waiting", "Requests waiting in the engine", s.num_waiting),
            ("moeserve_kv_cache_usage", "Share of KV blocks in use (0-1)", s.kv_usage),
            ("moeserve_num_requests_in_flight", "Requests submitted by the API process and not "
             "finished", self.client.num_in_flight),
            ("moeserve_engine_alive", "1 while the engine process is alive",
             int(self.client.alive)),
            ("moeserve_engine_step_seconds", "Wall time of the engine's last step", s.step_seconds),
            ("moeserve_engine_schedule_seconds", "CPU time of the last step's scheduling",
             s.schedule_seconds),
            ("moeserve_engine_loop_seconds", "Wall time of the engine loop's last busy "
             "iteration (intake, step, outputs)", s.loop_seconds),
            ("moeserve_engine_gpu_step_seconds", "Device time of the model forward (sampled "
             "step profile)", s.gpu_step_seconds),
            ("moeserve_engine_attention_seconds", "Device time of all attention layers in the "
             "sampled step", s.attention_seconds),
            ("moeserve_engine_moe_seconds", "Device time of all MoE blocks in the sampled step",
             s.moe_seconds),
            ("moeserve_engine_comm_seconds", "Device time of the collectives (tensor "
             "parallelism) in the latest eagerly run sampled step", s.comm_seconds),
            ("moeserve_generation_tokens_per_second", f"Output tokens per second streamed over "
             f"the last {self.meter.window} s", self.meter.rate()),
        ]
        gauges += _expert_load_gauges(s.expert_load)
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("moeserve_engine_steps", "Engine steps", s.num_steps),
            ("moeserve_engine_preemptions", "Requests preempted (recomputed later)",
             s.num_preemptions),
            ("moeserve_engine_prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
             "cache", s.num_prefix_hit_tokens),
            ("moeserve_engine_prompt_tokens", "Prompt tokens computed by the engine "
             "(recomputation included)", s.num_prompt_tokens),
            ("moeserve_engine_generation_tokens", "Tokens generated by the engine",
             s.num_generated_tokens),
            ("moeserve_engine_aborted_requests", "Requests aborted in the engine", s.num_aborted),
            ("moeserve_engine_failed_requests", "Requests failed by a fault of their own in the "
             "engine step (non-finite logits, a sampler error of that request alone, the largest "
             "request of two steps out of device memory)",
             s.num_failed),
            ("moeserve_engine_refused_requests", "Requests the engine refused", s.num_refused),
            ("moeserve_engine_oom_steps", "Forward steps that ran out of device memory (their "
             "requests preempted to recompute; the engine went on)", s.num_oom_steps),
            ("moeserve_engine_grammar_wait_steps", "Steps sampled after the step in flight "
             "settled (a structured output's mask needs its previous token)",
             s.num_grammar_waits),
            ("moeserve_engine_forward_steps", "Model forwards (a multi-step decode plan runs "
             "several per step)", s.num_forward_steps),
            ("moeserve_engine_graph_steps", "Forward steps replayed from a CUDA graph",
             s.num_graph_steps),
            ("moeserve_engine_mixed_graph_steps", "Mixed steps run through the piecewise CUDA "
             "graphs", s.num_mixed_graph_steps),
            ("moeserve_engine_cuda_graph_fallbacks", "Decode batches run eagerly on CUDA (no "
             "captured graph fitted)", s.cuda_graph_fallbacks),
            ("moeserve_engine_busy_iterations", "Engine loop iterations with work",
             s.num_busy_iterations),
            ("moeserve_engine_busy_loop_seconds", "Wall seconds of the engine loop's busy "
             "iterations", s.busy_loop_seconds_total),
            ("moeserve_engine_busy_step_seconds", "Wall seconds of core.step() in busy "
             "iterations", s.busy_step_seconds_total),
            ("moeserve_engine_busy_intake_seconds", "Wall seconds taking in requests and "
             "messages in busy iterations", s.busy_intake_seconds_total),
            ("moeserve_engine_busy_send_seconds", "Wall seconds sending outputs in busy "
             "iterations", s.busy_send_seconds_total),
            ("moeserve_engine_profiled_forwards", "Model forwards timed by the sampled step "
             "profile (every Nth)", s.num_profiled_forwards),
            ("moeserve_engine_profiled_device_seconds", "Device seconds of the profiled "
             "forwards", s.profiled_device_seconds_total),
            ("moeserve_engine_profiled_wall_seconds", "Wall seconds per forward of the engine "
             "steps that ran the profiled forwards, summed", s.profiled_wall_seconds_total),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


def _expert_load_gauges(load: dict | None) -> list[tuple[str, str, float]]:
    """Mean tokens per expert per step and the worst layer's imbalance (max / mean expert),
    from the engine's cumulative counts (refreshed at each scrape)."""
    if not load or not load["num_steps"] or not load["tokens_per_expert"]:
        return []
    layers = load["tokens_per_expert"]
    num_experts = len(layers[0])
    total = sum(sum(row) for row in layers)
    mean = total / (len(layers) * num_experts * load["num_steps"])
    imbalance = max((max(row) * num_experts / sum(row)) for row in layers if sum(row))
    return [("moeserve_expert_tokens_per_step", "Mean tokens per expert per MoE layer per "
             "engine step, since start-up", mean),
            ("moeserve_expert_load_imbalance", "Busiest expert over the mean expert, in the "
             "most imbalanced MoE layer, since start-up", imbalance)]


class _ApiCpuCollector:
    """CPU seconds of all API processes (this one alone unless the launcher lists several)."""

    def collect(self) -> Iterator[Metric]:
        pids = [os.getpid()]
        path = envs.api_pids_file()
        if path and os.path.exists(path):
            with open(path) as f:
                pids = [int(x) for x in f.read().split()]
        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        yield CounterMetricFamily("moeserve_api_cpu_seconds", "CPU seconds used by the API "
                                  "server processes, summed", value=total)


class ServerMetrics:
    def __init__(self, client: AsyncEngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # this API process's CPU and memory
        self.registry.register(_ApiCpuCollector())
        self.meter = RateMeter()
        r = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            # NOTE: several API processes (process/multiproc.py): the counters and histograms
            # below live in shared files and are summed over the processes at scrape time.
            MultiProcessCollector(self.registry)
            r = None
        self.prompt_tokens = Counter("moeserve_prompt_tokens", "Prompt tokens of accepted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("moeserve_generation_tokens", "Output tokens sent to "
                                         "clients", registry=r)
        self.requests = Counter("moeserve_requests", "Finished engine requests (one per choice) "
                                "by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("moeserve_requests_rejected", "HTTP requests refused: "
                                "invalid_request (400), queue_full (429), engine_unavailable "
                                "(503)", ["reason"], registry=r)
        self.disconnects = Counter("moeserve_client_disconnects", "Requests aborted because "
                                   "the client went away", registry=r)
        self.connections_refused = Counter("moeserve_connections_refused", "Connections "
                                           "refused at accept with HTTP 503: the connection cap "
                                           "(--max-connections) was reached", registry=r)
        self.num_connections = Gauge("moeserve_num_connections", "Open HTTP connections, "
                                     "refused ones included until they close",
                                     registry=r, multiprocess_mode="livesum")
        self.connection_timeouts = Counter("moeserve_connection_timeouts", "Connections whose "
                                           "request did not arrive in time: headers (closed), "
                                           "body (HTTP 408)", ["phase"], registry=r)
        self.ttft = Histogram("moeserve_time_to_first_token_seconds", "From the parsed request "
                              "to its first output token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("moeserve_time_per_output_token_seconds", "Per choice: (last token "
                              "- first token) / (tokens - 1)", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("moeserve_e2e_request_latency_seconds", "From the parsed request to "
                             "its last output", buckets=_LATENCY_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        for reason in ("invalid_request", "queue_full", "engine_unavailable"):
            self.rejected.labels(reason)
        for phase in ("headers", "body"):
            self.connection_timeouts.labels(phase)
        self.registry.register(_EngineCollector(client, self.meter))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one HTTP request (all its choices) and feeds the histograms and counters."""

    __slots__ = ("metrics", "start", "first", "_choice_first", "_choice_last", "_choice_tokens")

    def __init__(self, metrics: ServerMetrics, num_choices: int) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first: float | None = None
        self._choice_first = [0.0] * num_choices
        self._choice_last = [0.0] * num_choices
        self._choice_tokens = [0] * num_choices

    def on_tokens(self, choice: int, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        if not self._choice_tokens[choice]:
            self._choice_first[choice] = now
        self._choice_last[choice] = now
        self._choice_tokens[choice] += num_tokens
        self.metrics.generation_tokens.inc(num_tokens)
        self.metrics.meter.add(num_tokens)

    def on_finished(self, choice: int, finish_reason: str) -> None:
        m = self.metrics
        m.requests.labels(finish_reason).inc()
        n = self._choice_tokens[choice]
        if n > 1:
            m.tpot.observe((self._choice_last[choice] - self._choice_first[choice]) / (n - 1))

    def on_done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
