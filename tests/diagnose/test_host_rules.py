"""The host's rules: cpu_bound_step judged by the run's engine counters (the step profile's
forwards, count-uniform), not by the means of length-biased gauges; cpu_threads on a CPU engine
(synthetic run objects from synthetic.py)."""

from __future__ import annotations

from typing import Any

import pytest

from moeserve.diagnose.doctor import Verdict, diagnose, summary_lines
from tests.diagnose.synthetic import make_run

N = 82  # samples in the synthetic 20 s timeline


def _fired(run: dict) -> dict[str, Verdict]:
    return {v.rule: v for v in diagnose(run)}


def _loop(wall_ms: float, device_ms: float, profiled: int = 18, forwards: int = 576,
          steps: int | None = None, loop_ms: float | None = None,
          graph_share: float = 0.9) -> dict[str, float]:
    """The engine counters' growth over a run whose profiled forwards' steps took `wall_ms`
    per forward against `device_ms` on the device; every forward's step `wall_ms` too."""
    steps = forwards if steps is None else steps
    loop_ms = wall_ms + 1.0 if loop_ms is None else loop_ms
    return {"num_steps": steps, "num_forward_steps": forwards,
            "num_graph_steps": round(graph_share * forwards), "num_busy_iterations": steps,
            "busy_step_seconds_total": wall_ms * forwards / 1e3,
            "busy_loop_seconds_total": loop_ms * forwards / 1e3,
            "num_profiled_forwards": profiled,
            "profiled_device_seconds_total": profiled * device_ms / 1e3,
            "profiled_wall_seconds_total": profiled * wall_ms / 1e3}


# the gauges' means of the mixtral run (H200, W1 at 1,024): 178.23 ms a step, 94.37 ms on the GPU
MIXTRAL_GAUGES = {"step_seconds": [0.17823] * N, "gpu_step_seconds": [0.09437] * N}


def test_mixtral_counters_at_1_1x_are_not_cpu_bound_though_the_gauges_say_1_9x() -> None:
    """The gauges' ratio (1.9x) came from length-biased step_seconds samples; over the same
    forwards the steps took 1.1x their device time: no verdict. The process-CPU test would
    fire here (a saturated core, the GPU 45% busy): the counters take precedence over it."""
    run = make_run(step_ms=104.0, engine_cpu=1.0, util=45.0, stats_extra=MIXTRAL_GAUGES,
                   counters=_loop(wall_ms=103.46, device_ms=94.37, loop_ms=104.53))
    assert run["engine_run"]["profiled_wall_over_device"] == pytest.approx(1.096, abs=1e-3)
    assert "cpu_bound_step" not in _fired(run)
    assert any("18 profiled forwards, their steps 103.46 ms per forward vs 94.37 ms on the "
               "device (1.10x)" in line for line in summary_lines(run))


def test_counters_at_2x_fire_and_cite_their_figures() -> None:
    run = make_run(stats_extra={"step_seconds": [0.030] * N, "gpu_step_seconds": [0.025] * N},
                   counters=_loop(wall_ms=50.0, device_ms=25.0, profiled=40, forwards=1280,
                                  loop_ms=52.0))
    v = _fired(run)["cpu_bound_step"]
    assert v.severity == "critical"
    ev = v.evidence
    assert ev["source"].startswith("engine_run counters")
    assert (ev["num_profiled_forwards"], ev["wall_ms_per_forward"], ev["device_ms_per_forward"],
            ev["wall_over_device"]) == (40, 50.0, 25.0, 2.0)
    assert (ev["run_step_ms_per_forward"], ev["run_loop_ms_per_forward"]) == (50.0, 52.0)
    assert "step_ms" not in ev and "gpu_step_ms" not in ev  # no gauge was read
    assert ("over 40 profiled forwards a step took 50.00 ms per forward against 25.00 ms of "
            "device work (2.00x > 1.5)") in v.message
    assert "over all 1280 forwards the loop took 52.0 ms per forward" in v.message


def test_multi_step_plans_are_compared_per_forward() -> None:
    """4 forwards per step: the run's loop figures are per forward, not per step."""
    run = make_run(scheduler__num_continuous_decode_steps=4, async_scheduling=False,
                   counters=_loop(wall_ms=20.0, device_ms=8.0, forwards=1600, steps=400))
    v = _fired(run)["cpu_bound_step"]
    assert v.evidence["num_steps"] == 400 and v.evidence["num_forward_steps"] == 1600
    assert v.evidence["run_step_ms_per_forward"] == 20.0  # 32 s of steps / 1,600 forwards
    assert v.settings == {"num_continuous_decode_steps": 8, "async_scheduling": False}
    assert "--num-continuous-decode-steps 8" in v.knob


def test_gauges_alone_no_longer_fire() -> None:
    """A server reporting the gauges only: their means (25 ms vs 10) are not read; the
    process-CPU test decides (the engine at 100% of a core while the GPU is 97% busy: no)."""
    run = make_run(stats_extra={"gpu_step_seconds": [0.010] * N})
    assert "cpu_bound_step" not in _fired(run)


def test_process_cpu_fallback_without_counters() -> None:
    fired = _fired(make_run(engine_cpu=1.0, util=35, power=450))
    assert set(fired) == {"cpu_bound_step"}
    v = fired["cpu_bound_step"]
    assert v.evidence["engine_cpu_fraction"] == 1.0 and v.evidence["gpu_util_pct"] == 35
    assert v.evidence["source"].startswith("process CPU")
    assert "CUDA graphs" in v.knob  # async scheduling is already on in the synthetic config
    # too few profiled forwards to judge by: the fallback too
    run = make_run(engine_cpu=1.0, util=35, power=450,
                   counters=_loop(wall_ms=20.0, device_ms=19.0, profiled=2))
    assert _fired(run)["cpu_bound_step"].evidence["source"].startswith("process CPU")


def test_eager_forwards_name_the_prefill_delay() -> None:
    """Graphs on, but only a quarter of the forwards replayed one: mixed steps."""
    run = make_run(counters=_loop(wall_ms=50.0, device_ms=25.0, graph_share=0.25))
    v = _fired(run)["cpu_bound_step"]
    assert "75% of forwards ran eagerly" in v.knob and "--prefill-batch-delay-steps 4" in v.knob
    assert v.settings == {"prefill_batch_delay_steps": 4}
    run = make_run(scheduler__prefill_batch_delay_steps=3,
                   counters=_loop(wall_ms=50.0, device_ms=25.0, graph_share=0.25))
    assert _fired(run)["cpu_bound_step"].settings == {"prefill_batch_delay_steps": 6}
    run = make_run(counters=_loop(wall_ms=50.0, device_ms=25.0, graph_share=1.0))
    assert "ran eagerly" not in _fired(run)["cpu_bound_step"].knob


@pytest.mark.parametrize("knobs, settings, flag", [
    ({"async_scheduling": False}, {"async_scheduling": True}, "--async-scheduling"),
    ({"enforce_eager": True}, {"enforce_eager": False}, "--no-enforce-eager"),
    ({}, {"num_continuous_decode_steps": 2, "async_scheduling": False},
     "--num-continuous-decode-steps 2"),
])
def test_cpu_bound_step_settings(knobs: dict, settings: dict, flag: str) -> None:
    run = make_run(counters=_loop(wall_ms=50.0, device_ms=25.0), **knobs)
    v = _fired(run)["cpu_bound_step"]
    assert v.settings == settings and flag in v.knob


def test_graphs_off_come_before_the_eager_forwards() -> None:
    """Every forward eager because a backend keeps the graphs off: the fix is the backend,
    not fewer mixed steps."""
    run = make_run(cuda_graphs="off: attention backend 'torch' cannot be captured (use triton)",
                   counters=_loop(wall_ms=50.0, device_ms=25.0, graph_share=0.0))
    v = _fired(run)["cpu_bound_step"]
    assert v.settings == {"attention_backend": "triton"}
    assert v.knob.startswith("--attention-backend triton: CUDA graphs are off")
    assert _fired(run)["cuda_graphs"].settings == v.settings


# ---- CPU engines -------------------------------------------------------------------------------

def _cpu_run(threads: int, cores: int | None, engine_cpu: float, **kw: Any) -> dict:
    extra = {"torch_threads": threads} | ({"usable_cores": cores} if cores else {})
    return make_run(device="cpu", device_name="x86_64", cuda_graphs="off: CPU", expert_tpe=2.0,
                    engine_cpu=engine_cpu, capacity_extra=extra, **kw)


def test_tiny_cpu_run_gets_no_tokens_per_expert() -> None:
    """2 tokens per expert per step, on CPU: not a verdict there (a CPU's expert GEMMs are not
    weight-streaming bound); a healthy CPU engine (2 threads, 2 cores, 1.8 cores used) gets
    none at all."""
    run = _cpu_run(threads=2, cores=2, engine_cpu=1.8)
    assert diagnose(run) == []
    assert "CPU: 2 torch threads, 2 usable cores, the engine process used 1.8 cores" in \
        summary_lines(run)
    # the same load on a GPU engine is a verdict
    assert "tokens_per_expert" in _fired(make_run(expert_tpe=2.0))


def test_cpu_threads_oversubscribed() -> None:
    v = _fired(_cpu_run(threads=8, cores=2, engine_cpu=1.9))["cpu_threads"]
    assert v.severity == "critical"
    assert v.evidence["torch_threads"] == 8 and v.evidence["usable_cores"] == 2
    assert "--torch-threads 2" in v.knob and v.settings == {"torch_threads": 2}
    assert "8 CPU threads on 2 usable cores" in v.message


def test_cpu_threads_starved_engine_process() -> None:
    """8 threads on 8 usable cores, yet the engine got 1.5 cores while its loop was busy 90%
    of the run (1.67 cores while busy): the cores are taken by other processes."""
    counters = {"num_steps": 800, "num_busy_iterations": 800, "busy_loop_seconds_total": 18.0,
                "busy_step_seconds_total": 17.0}
    run = _cpu_run(threads=8, cores=8, engine_cpu=1.5, counters=counters)
    v = _fired(run)["cpu_threads"]
    assert v.severity == "warning"
    ev = v.evidence
    assert ev["torch_threads"] == 8 and ev["usable_cores"] == 8
    assert ev["engine_cores_while_busy"] == pytest.approx(1.67, abs=0.01)
    assert ev["busy_share"] == 0.9
    assert "--torch-threads 2 (what it gets), or free the cores" in v.knob
    assert v.settings == {"torch_threads": 2}
    assert "other processes hold the cores" in v.message
    # the same CPU over a mostly idle loop (busy 20% of the run) says nothing
    idle = counters | {"busy_loop_seconds_total": 4.0}
    assert "cpu_threads" not in _fired(_cpu_run(threads=8, cores=8, engine_cpu=0.3,
                                                 counters=idle))


def test_cpu_threads_from_the_engine_config_without_report_fields() -> None:
    """An engine whose report lacks torch_threads: the resolved engine config's; without
    usable_cores oversubscription cannot be told, starvation still can (busy from the
    timeline: requests ran in every sample)."""
    run = make_run(device="cpu", device_name="x86_64", expert_tpe=None, engine_cpu=0.9,
                   torch_threads=4)
    v = _fired(run)["cpu_threads"]
    assert v.evidence["torch_threads"] == 4 and v.evidence["usable_cores"] is None
    assert v.evidence["busy_share"] == 1.0 and v.settings == {"torch_threads": 1}
    assert "cpu_threads" not in _fired(make_run(device="cpu", device_name="x86_64",
                                                expert_tpe=None, engine_cpu=3.5,
                                                torch_threads=4))
    # a GPU engine is not judged by its CPU threads
    assert "cpu_threads" not in _fired(make_run(engine_cpu=0.5, capacity_extra={
        "torch_threads": 16, "usable_cores": 4}))


def test_host_time_not_overlapped_is_a_warning_when_overlap_is_off() -> None:
    # the H200's qwen3 W1 at 1,024, graphs on, overlap off: 36.2 ms a forward against 26.9
    off = make_run(counters=_loop(wall_ms=36.2, device_ms=26.9), async_scheduling=False)
    v = _fired(off)["cpu_bound_step"]
    assert v.severity == "warning" and v.settings == {"async_scheduling": True}
    assert "host time not overlapped" in v.message and v.evidence["threshold"] == 1.2
    assert "9.30 ms of host work per forward" in v.message
    on = make_run(counters=_loop(wall_ms=36.2, device_ms=26.9), async_scheduling=True)
    assert "cpu_bound_step" not in _fired(on)  # overlap already on: 1.35x is not CPU-bound
    close = make_run(counters=_loop(wall_ms=30.0, device_ms=26.9), async_scheduling=False)
    assert "cpu_bound_step" not in _fired(close)


def test_grammar_steps_name_the_masks_and_no_flag() -> None:
    """W1 at 1,024 under a regex (gpu_ff7b345/call3): every step but the first waited for its
    predecessor's tokens for its masks. Multi-step decode, the default last resort, skips such
    steps: the doctor names the masks and proposes no engine setting."""
    counters = _loop(wall_ms=47.2, device_ms=26.8, steps=409, forwards=409)
    run = make_run(counters={**counters, "num_grammar_waits": 408})
    v = _fired(run)["cpu_bound_step"]
    assert v.settings == {} and v.knob.startswith("100% of steps held a structured output's")
    assert "--num-continuous-decode-steps skips them" in v.knob
    few = make_run(counters={**counters, "num_grammar_waits": 40})
    assert _fired(few)["cpu_bound_step"].settings == {"num_continuous_decode_steps": 2,
                                                      "async_scheduling": False}
