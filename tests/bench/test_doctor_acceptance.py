"""benchmarks/engine/doctor_acceptance/run.py's pure helpers (plan.py): the plan, the
overhead figures, the cap check, the servers' and runs' arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.engine.doctor_acceptance import plan
from benchmarks.engine.doctor_acceptance import run as da


def _plan(design: str = "two-servers", **kw: object) -> list[plan.Step]:
    args = {"preset": "p", "concurrency": 8, "cap": 2, "n_cap": 10, "n_auto": 20,
            "n_overhead": 20, "repeats": 3, "design": design}
    args.update(kw)
    return plan.plan_steps(**args)  # type: ignore[arg-type]


def _seq(steps: list[plan.Step]) -> list[tuple[str, str, bool]]:
    return [(s.name, s.server, s.diagnose) for s in steps]


def test_two_servers_plan_reuses_the_auto_run_as_the_first_on_run() -> None:
    steps = _plan()
    assert _seq(steps) == [
        ("w1_p_c8_cap2", "cap", True), ("w1_p_c8_auto", "on", True), ("report", "", False),
        ("w1_p_c8_on2", "on", True), ("w1_p_c8_on3", "on", True),
        ("w1_p_c8_off1", "off", False), ("w1_p_c8_off2", "off", False),
        ("w1_p_c8_off3", "off", False)]
    assert steps[1].roles == ("auto", "on") and steps[0].num_prompts == 10
    assert steps[3].file == "overhead/w1_p_c8_on2.jsonl"


def test_interleaved_designs() -> None:
    one = _plan("one-server")
    assert [(s.name, s.server, s.diagnose) for s in one[3:]] == [
        ("w1_p_c8_off1", "on", False), ("w1_p_c8_on2", "on", True),
        ("w1_p_c8_off2", "on", False), ("w1_p_c8_on3", "on", True),
        ("w1_p_c8_off3", "on", False)]
    restarts = [s.server for s in _plan("restarts") if s.kind == "run"]
    assert restarts == ["cap", "on", "off", "on", "off", "on", "off"]


def test_plan_options() -> None:
    # a different prompt count: the auto run is not an "on" run, so three more are planned
    steps = _plan(n_overhead=30)
    assert steps[1].roles == ("auto",)
    assert [s.name for s in steps if "on" in s.roles] == ["w1_p_c8_on1", "w1_p_c8_on2",
                                                           "w1_p_c8_on3"]
    assert [s.name for s in _plan(skip_overhead=True)] == ["w1_p_c8_cap2", "w1_p_c8_auto",
                                                           "report"]
    assert [s.name for s in _plan(skip_cap=True)][:2] == ["w1_p_c8_auto", "w1_p_c8_on2"]
    with pytest.raises(ValueError, match="overhead-design"):
        _plan("nope")


def test_overhead_median_and_range() -> None:
    doc = plan.overhead([98.0, 99.0, 100.0], [100.0, 101.0, 99.0])
    assert doc["on"]["median"] == 99.0 and doc["off"]["median"] == 100.0
    assert doc["overhead_pct"] == pytest.approx(1.0)
    best, worst = doc["overhead_pct_range"]
    assert best == pytest.approx(100 * (1 - 100 / 99), abs=1e-3)  # rounded to 3 places
    assert worst == pytest.approx(100 * (1 - 98 / 101), abs=1e-3)
    assert doc["within_target"] is True
    assert doc["on"]["spread_pct"] == pytest.approx(100 * 2 / 99, abs=1e-3)
    assert plan.overhead([90.0], [100.0])["within_target"] is False
    empty = plan.overhead([], [100.0])
    assert empty["overhead_pct"] is None and empty["on"]["n"] == 0


def test_cap_check_and_verdict_rules() -> None:
    verdicts = [{"rule": "admission_cap", "severity": "critical"}, {"rule": "roofline"}]
    assert plan.verdict_rules(verdicts) == ["admission_cap", "roofline"]
    assert plan.verdict_rules(None) == []
    assert plan.cap_check(["admission_cap"], ["roofline"])["pass"] is True
    assert plan.cap_check(["admission_cap"], ["admission_cap"])["pass"] is False
    assert plan.cap_check([], [])["pass"] is False
    assert plan.bound_flags({"client_bound": True, "verdicts": [{"rule": "api_bound"}]}) == [
        "api_bound", "client_bound"]


def test_slim_result_drops_chunk_lists() -> None:
    res = {"requests": [{"prompt_len": 4, "chunk_times": [0.1, 0.2], "chunk_tokens": [1, 1]}]}
    assert plan.slim_result(res)["requests"] == [{"prompt_len": 4, "num_chunks": 2}]


def test_args_and_server_flags() -> None:
    a = da.parse_args(["--num-prompts", "32", "--num-prompts-cap", "16",
                       "--server-args", "--device cpu"])
    assert (a.num_prompts_cap, a.num_prompts_auto, a.num_prompts_overhead) == (16, 32, 32)
    assert plan.server_args("cap", a) == ["--device", "cpu", "--max-running-requests", "64"]
    assert plan.server_args("off", a) == ["--device", "cpu", "--no-collect-expert-load",
                                        "--step-profile-every", "0"]
    assert plan.server_args("on", a) == ["--device", "cpu"]
    d = da.parse_args([])
    assert (d.num_prompts_cap, d.num_prompts_auto, d.num_prompts_overhead) == (1024, 2048, 2048)
    step = plan.Step("x", server="on", diagnose=True, num_prompts=5)
    argv = plan.bench_argv(step, d, 7, Path("/tmp/r.jsonl"))
    assert argv[-1] == "--diagnose" and "--seed" in argv and argv[argv.index("--seed") + 1] == "7"
