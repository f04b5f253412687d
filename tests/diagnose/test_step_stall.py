"""The doctor's step_stall rule (host_rules.py) over a run's slow steps (bench/engine_run.py)."""

from __future__ import annotations

import pytest

from moeserve.diagnose.doctor import diagnose
from tests.diagnose.synthetic import make_run

# gpu_e6ddc73/call4's first run: 1,091 steps of 29.07 ms, 1,048,576 prompt and 131,072 output
# tokens in 32.0 s; one decode step of 128 rows stalled 1.52 s
STEPS, STEP_S = 1091, 0.02907
PREFILL = [3, 0.30, 8192, 0, 0]  # a slow step its tokens explain (37 us a token)
STALL = [500, 1.516, 0, 128, 128]


def _run(slow: list[list[float]], duration: float = 32.0) -> dict:
    counters = {"num_steps": STEPS, "num_busy_iterations": STEPS,
                "busy_step_seconds_total": STEPS * STEP_S, "num_prompt_tokens": 1048576,
                "num_generated_tokens": 131072, "num_recorded_steps": STEPS,
                "slow_steps": slow}
    return make_run(duration=duration, counters=counters)


def _verdict(run: dict):
    return {v.rule: v for v in diagnose(run)}.get("step_stall")


def test_a_decode_step_stalled_for_a_second_and_a_half_is_named() -> None:
    run = _run([PREFILL, STALL])
    assert [s["step"] for s in run["engine_run"]["slow_steps"]] == [3, 500]
    v = _verdict(run)
    assert v is not None and v.severity == "warning" and v.settings == {}
    assert v.evidence["slow_steps"] == [run["engine_run"]["slow_steps"][1]]  # not the prefill
    assert v.evidence["stalled_seconds"] == pytest.approx(1.516)
    assert v.evidence["share_of_run"] == pytest.approx(1.516 / 32.0, abs=1e-4)
    assert ("1 step(s) took far longer than their tokens explain: the longest 1.52 s (step 500 "
            "of the run: 0 prompt tokens, 128 decode rows) against 0.027 ms a token"
            in v.message)
    assert "compiled at its first use" in v.knob


def test_slow_steps_their_tokens_explain_are_no_verdict() -> None:
    assert _verdict(_run([PREFILL])) is None
    assert _verdict(_run([])) is None
    assert _verdict(make_run()) is None  # a server without slow steps


def test_a_short_stall_in_a_long_run_is_information() -> None:
    v = _verdict(_run([[500, 0.26, 0, 2, 2]], duration=100.0))
    assert v is not None and v.severity == "info"


def test_a_malformed_slow_step_names_its_field() -> None:
    run = _run([STALL])
    run["engine_run"]["slow_steps"][0]["seconds"] = "1.5"
    with pytest.raises(ValueError, match=r"engine_run.slow_steps\[0\] needs numbers seconds"):
        diagnose(run)
    run["engine_run"]["slow_steps"] = {"step": 1}
    with pytest.raises(ValueError, match="engine_run.slow_steps must be a list"):
        diagnose(run)
