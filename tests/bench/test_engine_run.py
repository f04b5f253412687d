"""bench/engine_run.py: the run's share of the engine's counters, and its derived figures."""

from __future__ import annotations

import pytest

from moeserve.bench.engine_run import describe, engine_run


def _stats(steps: int, graphs: int, iters: int, loop: float, step: float,
           tokens: int) -> dict:
    return {"num_steps": steps, "num_forward_steps": steps, "num_graph_steps": graphs,
            "cuda_graph_fallbacks": 1,
            "num_generated_tokens": tokens, "num_busy_iterations": iters,
            "busy_loop_seconds_total": loop, "busy_step_seconds_total": step,
            "busy_intake_seconds_total": 0.0, "busy_send_seconds_total": loop - step,
            "num_running": 7, "kv_usage": 0.5}


def test_difference_of_two_snapshots() -> None:
    run = engine_run(_stats(10, 4, 10, 1.0, 0.8, 100), _stats(110, 94, 110, 3.0, 2.2, 5100), 4.0)
    c = run["counters"]
    assert c["num_steps"] == 100 and c["num_graph_steps"] == 90 and c["cuda_graph_fallbacks"] == 0
    assert "num_running" not in c and "kv_usage" not in c  # gauges have no difference
    assert run["graph_step_share"] == pytest.approx(0.9)
    assert run["generated_tokens_per_step"] == pytest.approx(50)
    assert run["mean_loop_ms"] == pytest.approx(20.0) and run["mean_step_ms"] == pytest.approx(14)
    assert run["mean_send_ms"] == pytest.approx(6.0)
    assert run["busy_share"] == pytest.approx(0.5)
    line = describe(run)
    assert line.startswith("engine: 100 steps, 90% of forwards from CUDA graphs, 0 eager decode "
                           "fallbacks")
    assert "20.00 ms (step 14.00" in line


def test_multi_step_plans_share_graphs_by_forward() -> None:
    before = _stats(0, 0, 0, 0.0, 0.0, 0)
    after = _stats(10, 36, 10, 1.0, 0.9, 4000) | {"num_forward_steps": 40}
    run = engine_run(before, after, 1.0)
    assert run["graph_step_share"] == pytest.approx(0.9)  # 36 of 40 forwards, not 36 of 10
    assert describe(run).startswith("engine: 10 steps, 40 forwards, 90% of forwards")


def test_mixed_graph_steps_beside_the_decode_share() -> None:
    before = _stats(0, 0, 0, 0.0, 0.0, 0) | {"num_mixed_graph_steps": 0}
    after = _stats(100, 80, 100, 1.0, 0.9, 4000) | {"num_mixed_graph_steps": 15}
    run = engine_run(before, after, 1.0)
    assert run["counters"]["num_mixed_graph_steps"] == 15
    assert run["mixed_graph_step_share"] == pytest.approx(0.15)
    assert ("80% of forwards from CUDA graphs, 15% mixed steps from piecewise graphs"
            in describe(run))
    assert "mixed" not in describe(engine_run(_stats(0, 0, 0, 0.0, 0.0, 0),
                                              _stats(9, 9, 9, 1.0, 0.9, 9), 1.0))


def test_missing_snapshot_or_fields() -> None:
    assert engine_run(None, _stats(1, 0, 1, 0.1, 0.1, 1), 1.0) is None
    assert engine_run(_stats(1, 0, 1, 0.1, 0.1, 1), None, 1.0) is None
    old = {"num_steps": 3, "num_generated_tokens": 30}  # a server from before the loop totals
    run = engine_run(old, {"num_steps": 5, "num_generated_tokens": 50}, 1.0)
    assert run["counters"] == {"num_steps": 2, "num_generated_tokens": 20}
    assert "mean_loop_ms" not in run and "busy_share" not in run
    assert describe(run) == "engine: 2 steps"
    assert describe(engine_run(old, old, 1.0)) is None  # no steps in the run


def test_profiled_forwards_wall_against_device() -> None:
    """The step profile's totals: over the same sampled forwards, their steps' wall time per
    forward against their device time; and the whole run's step time per forward."""
    before = _stats(0, 0, 0, 0.0, 0.0, 0) | {"num_profiled_forwards": 2,
                                              "profiled_device_seconds_total": 0.2,
                                              "profiled_wall_seconds_total": 0.25}
    after = _stats(100, 360, 100, 4.4, 4.0, 4000) | {
        "num_forward_steps": 400, "num_profiled_forwards": 12,
        "profiled_device_seconds_total": 0.28, "profiled_wall_seconds_total": 0.35}
    run = engine_run(before, after, 5.0)
    assert run["counters"]["num_profiled_forwards"] == 10
    assert run["profiled_device_ms_per_forward"] == pytest.approx(8.0)
    assert run["profiled_wall_ms_per_forward"] == pytest.approx(10.0)
    assert run["profiled_wall_over_device"] == pytest.approx(1.25)
    assert run["step_ms_per_forward"] == pytest.approx(10.0)  # 4 s over 400 forwards
    assert describe(run).endswith("; 10 profiled forwards: their steps' wall 10.00 ms per "
                                  "forward, device 8.00 ms (1.25x)")


def test_the_runs_slow_steps_are_those_numbered_after_its_start() -> None:
    """The engine's latest slow steps (engine/step_counters.py) within the run, numbered from
    its first step; a server without them gives none."""
    before = _stats(0, 0, 0, 0.0, 0.0, 0) | {"num_recorded_steps": 40,
                                             "slow_steps": [[12, 0.9, 4096, 0, 0]]}
    after = _stats(9, 9, 9, 1.0, 0.9, 9) | {
        "num_recorded_steps": 140,
        "slow_steps": [[12, 0.9, 4096, 0, 0], [40, 0.3, 0, 8, 8], [41, 1.5, 0, 128, 128],
                       [90, 0.4, 8192, 64, 65]]}
    run = engine_run(before, after, 1.0)
    assert run["counters"]["num_recorded_steps"] == 100
    assert run["slow_steps"] == [
        {"step": 1, "seconds": 1.5, "prompt_tokens": 0, "decode_rows": 128,
         "generated_tokens": 128},
        {"step": 50, "seconds": 0.4, "prompt_tokens": 8192, "decode_rows": 64,
         "generated_tokens": 65}]
    assert describe(run).endswith("; 2 recent steps of 0.25 s or more (the longest 1.50 s)")
    assert "slow_steps" not in engine_run(_stats(0, 0, 0, 0.0, 0.0, 0),
                                          _stats(9, 9, 9, 1.0, 0.9, 9), 1.0)
