"""A fake benchmark for the tune's tests: a known function of the CUDA knob space.

    throughput(params)  the noise-free objective: a product of one factor per knob, so its
                        optimum is known (OPTIMUM): cap >= the concurrency, graphs on, tuned
                        tiles, overlap on, 8,192 batched tokens, measured MoE, block 16, a
                        short prefill delay, mem_fraction 0.925
    OOM                 mem_fraction above 0.925 runs out of memory: right next to the optimum
    FakeEvaluator       the Evaluator the study calls: seeded multiplicative noise, the doctor's
                        verdicts (with settings, as doctor.Verdict gives them) for the knobs a
                        reader of the logs would move, infeasible outcomes for the OOM region
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from moeserve.tune.evaluate import Outcome
from moeserve.tune.space import knob_space

CONCURRENCY = 1024
BASE = 30_000.0
OOM_ABOVE = 0.925


def _cap(params: Mapping[str, Any]) -> int:
    cap = params["max_running_requests"]
    return 2048 if cap == "auto" else int(cap)


def throughput(params: Mapping[str, Any]) -> float:
    cap = _cap(params)
    f = (min(cap, CONCURRENCY) / CONCURRENCY) ** 0.8 * (0.97 if cap > CONCURRENCY else 1.0)
    f *= 0.6 if params["enforce_eager"] else 1.0
    if not params["enforce_eager"]:
        f *= {"auto": 1.0, 1024: 1.0, 256: 0.9, 64: 0.8}[params["cuda_graph_max_batch_size"]]
    f *= 0.85 if params["moe_tiles"] == "default" else 1.0
    if params["async_scheduling"] is False:
        f *= 0.9 * (1 + 0.02 * (min(params["num_continuous_decode_steps"], 4) - 1))
    f *= {2048: 0.9, 4096: 0.96, 8192: 1.0, 16384: 0.99, 32768: 0.97}[
        params["max_num_batched_tokens"]]
    f *= {16: 1.0, 32: 0.99, 64: 0.97}[params["block_size"]]
    f *= {"auto": 1.0, "measured": 1.0, "triton": 0.98, "grouped_mm": 0.8}[params["moe_backend"]]
    d = params["prefill_batch_delay_steps"]
    f *= 1.0 + 0.01 * min(d, 2) - 0.01 * max(0, d - 2)
    f *= 1.0 + 0.1 * (min(params["mem_fraction"], OOM_ABOVE) - 0.8) / (OOM_ABOVE - 0.8)
    return BASE * f


OPTIMUM = throughput({"max_running_requests": 1024, "enforce_eager": False,
                      "cuda_graph_max_batch_size": "auto", "moe_tiles": "tuned",
                      "async_scheduling": True, "num_continuous_decode_steps": 1,
                      "max_num_batched_tokens": 8192, "block_size": 16, "moe_backend": "auto",
                      "prefill_batch_delay_steps": 2, "mem_fraction": OOM_ABOVE})

BAD_START = {"max_running_requests": 64, "moe_tiles": "default", "enforce_eager": True,
             "async_scheduling": False}


def verdicts(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    if _cap(params) < CONCURRENCY:
        out.append({"rule": "admission_cap", "severity": "critical", "knob": "",
                    "message": "admission cap binding",
                    "settings": {"max_running_requests": CONCURRENCY}})
    if params["enforce_eager"]:
        out.append({"rule": "cuda_graphs", "severity": "warning", "knob": "",
                    "message": "decode outside CUDA graphs", "settings": {"enforce_eager": False}})
    if params["async_scheduling"] is False:
        out.append({"rule": "cpu_bound_step", "severity": "critical", "knob": "",
                    "message": "CPU-bound loop", "settings": {"async_scheduling": True}})
    if params["moe_tiles"] == "default":
        out.append({"rule": "moe_tiles", "severity": "warning", "knob": "",
                    "message": "default MoE tiles", "settings": {"moe_tiles": "tuned"}})
    return out


def run_seconds(params: Mapping[str, Any]) -> float:
    """A run's fake duration: the same prompts through a low admission cap take longer (the
    seeds' bad start took minutes a run where the winner took seconds)."""
    return 10.0 * CONCURRENCY / _cap(params)


class FakeClock:
    """An injected clock that the fake evaluator moves on by each run's seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEvaluator:
    """Seeded noise (`noise` relative, Gaussian); every call is recorded in `calls`."""

    def __init__(self, seed: int = 0, noise: float = 0.01, fn=throughput,
                 on_evaluate=None, clock: FakeClock | None = None) -> None:
        self.rng = random.Random(seed)
        self.noise = noise
        self.fn = fn
        self.calls: list[tuple[dict[str, Any], str]] = []
        self.on_evaluate = on_evaluate
        self.clock = clock

    def evaluate(self, params: Mapping[str, Any], purpose: str) -> Outcome:
        self.calls.append((dict(params), purpose))
        params = {**knob_space("cuda", {}).start, **params}  # a study of a few knobs: the rest
        if self.on_evaluate is not None:
            self.on_evaluate(len(self.calls), params)
        if params["mem_fraction"] > OOM_ABOVE:
            return Outcome(None, failure="oom", error="torch.OutOfMemoryError: CUDA out of "
                           f"memory (fake: mem_fraction {params['mem_fraction']} > {OOM_ABOVE})")
        value = self.fn(params) * (1.0 + self.rng.gauss(0.0, self.noise))
        seconds = run_seconds(params)
        if self.clock is not None:
            self.clock.now += seconds
        run = {"output_throughput": value, "median_tpot_ms": 20.0, "p99_ttft_ms": 900.0,
               "completed": CONCURRENCY, "failed": 0, "max_concurrency": CONCURRENCY}
        return Outcome(value, runs=[run], verdicts=verdicts(params),
                       capacity={"max_running_requests": _cap(params)}, seconds=seconds,
                       command="fake")


class Interrupt:
    """An `on_evaluate` hook: Ctrl-C at the `at`-th evaluation (1-based), before it runs."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, n: int, params: Mapping[str, Any]) -> None:
        if n == self.at:
            raise KeyboardInterrupt
