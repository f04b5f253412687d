"""The doctor on an engine over several ranks: the communication-bound verdict with its knob,
quiet on one rank and under the threshold, and the EP ranks' share of the routed tokens."""

from __future__ import annotations

from moeserve.diagnose.doctor import diagnose, summary_lines
from moeserve.diagnose.parallel_rules import ep_rank_load
from tests.diagnose.synthetic import make_run


def _series(value: float, run_len: int = 82) -> list[float]:
    return [value] * run_len


def _run(comm_ms: float, step_ms: float = 20.0, **knobs) -> dict:
    return make_run(stats_extra={"comm_seconds": _series(comm_ms / 1e3),
                                 "eager_step_seconds": _series(step_ms / 1e3)},
                    **{"parallel__tensor_parallel_size": 8, **knobs})


def test_a_communication_bound_step_names_fewer_ranks() -> None:
    fired = {v.rule: v for v in diagnose(_run(comm_ms=12.0))}
    v = fired["communication"]
    assert v.severity == "critical"  # 60% of the step
    assert v.evidence["comm_share"] == 0.6 and v.evidence["tensor_parallel_size"] == 8
    assert "--tp 4" in v.knob and v.settings == {"tensor_parallel_size": 4}
    assert "60%" in v.message and "12.00 of 20.00 ms" in v.message


def test_quiet_under_the_share_and_on_one_rank() -> None:
    assert "communication" not in {v.rule for v in diagnose(_run(comm_ms=4.0))}
    one = make_run(stats_extra={"comm_seconds": _series(0.015),
                                "eager_step_seconds": _series(0.02)})
    assert "communication" not in {v.rule for v in diagnose(one)}


def test_ep_ranks_share_of_the_routed_tokens() -> None:
    run = _run(comm_ms=12.0, parallel__enable_expert_parallel=True)
    load = run["diagnostics"]["expert_load"]["tokens_per_expert"]
    for row in load:  # the first 16 experts (EP rank 0's) get three times the others' tokens
        row[:16] = [3 * x for x in row[:16]]
    shares = ep_rank_load(run)
    assert len(shares) == 8 and abs(sum(shares) - 1) < 1e-9
    assert abs(shares[0] / shares[1] - 3.0) < 1e-9
    assert any(line.startswith("experts by EP rank: rank 0 30%") for line in summary_lines(run))
    v = {v.rule: v for v in diagnose(run)}["communication"]
    assert v.evidence["expert_parallel_size"] == 8
    assert len(v.evidence["ep_rank_token_shares"]) == 8
