"""Confirmation and ablation against the fake benchmark: a gain inside the spread is noise,
one beyond it is a gain; the ablation ranks the knobs by what setting each back costs."""

from __future__ import annotations

import pytest

from moeserve.tune import confirm as confirm_mod
from moeserve.tune import study as study_mod
from moeserve.tune.ablation import ablate, importances
from moeserve.tune.deadline import Deadline, OutOfTime
from moeserve.tune.space import knob_space
from tests.tune.fake_bench import BAD_START, FakeClock, FakeEvaluator, Interrupt, throughput


def _arms(space, **moved):
    return {"best": space.complete({**space.start, **moved}), "start": space.start}


def test_a_difference_inside_the_noise_is_called_noise():
    space = knob_space("cuda", {})
    # block 32 vs 16: 1% apart, measured with 4% noise
    c = confirm_mod.confirm(FakeEvaluator(seed=5, noise=0.04), _arms(space, block_size=32), 3)
    assert c.verdict == "noise"
    assert abs(c.difference) <= c.spread
    assert "noise" in c.line()
    assert [a.name for a in c.arms] == ["best", "start"] and all(len(a.values) == 3
                                                                 for a in c.arms)


def test_a_real_gain_beyond_the_spread_is_a_gain():
    space = knob_space("cuda", BAD_START)
    c = confirm_mod.confirm(FakeEvaluator(seed=5, noise=0.02),
                            _arms(space, max_running_requests=1024), 3)
    assert c.verdict == "gain" and c.gain > 1.0


def test_confirmation_alternates_the_arms_on_fresh_runs():
    space = knob_space("cuda", BAD_START)
    ev = FakeEvaluator()
    arms = _arms(space, enforce_eager=False) | {
        "defaults": {n: k.default for n, k in space.knobs.items()}}
    confirm_mod.confirm(ev, arms, 2)
    order = [next(n for n, p in arms.items() if p == params) for params, _ in ev.calls]
    assert order == ["best", "start", "defaults"] * 2
    assert {purpose for _, purpose in ev.calls} == {"confirm"}


def test_a_failed_arm_is_unknown_not_a_gain():
    space = knob_space("cuda", {})
    arms = _arms(space, mem_fraction=0.95)  # the fake's OOM region
    c = confirm_mod.confirm(FakeEvaluator(), arms, 2)
    assert c.verdict == "unknown" and c.arms[0].failures and c.arms[0].mean is None
    with pytest.raises(ValueError, match="runs must be"):
        confirm_mod.confirm(FakeEvaluator(), arms, 0)


def test_ablation_names_the_largest_lever():
    space = knob_space("cuda", BAD_START)
    winner = space.complete({"max_running_requests": 1024, "enforce_eager": False,
                             "moe_tiles": "tuned", "async_scheduling": None})
    ref, rows = ablate(FakeEvaluator(noise=0.0), space, winner, space.start)
    assert ref == pytest.approx(throughput(winner))
    assert [r.knob for r in rows][0] == "max_running_requests"
    assert {r.knob for r in rows} == {"max_running_requests", "enforce_eager", "moe_tiles",
                                      "async_scheduling"}
    assert all(r.worth > 0 for r in rows)


def test_importances_after_a_study(tmp_path):
    study = study_mod.open_study(f"sqlite:///{tmp_path / 't.db'}", "imp", 0, 4)
    space = knob_space("cuda", BAD_START)
    study_mod.search(study, space, FakeEvaluator(), study_mod.Budget(n_trials=12))
    imp, why = importances(study)
    assert why == "" and imp and abs(sum(imp.values()) - 1.0) < 1e-3
    assert set(imp) <= set(space.knobs)


def test_a_cut_confirmation_resumes_run_by_run():
    space = knob_space("cuda", BAD_START)
    arms = _arms(space, max_running_requests=1024)
    saved: list = []

    with pytest.raises(KeyboardInterrupt):
        confirm_mod.confirm(FakeEvaluator(on_evaluate=Interrupt(at=4)), arms, 2,
                            save=lambda records: saved.append(list(records)))
    assert len(saved[-1]) == 3  # best, start, best: kept
    ev = FakeEvaluator()
    c = confirm_mod.confirm(ev, arms, 2, done=saved[-1])
    assert len(ev.calls) == 1  # only the start's second run was left
    assert [len(a.values) for a in c.arms] == [2, 2]


def test_a_cut_ablation_resumes_run_by_run():
    space = knob_space("cuda", BAD_START)
    winner = space.complete({"max_running_requests": 1024, "enforce_eager": False})
    saved: list = []

    with pytest.raises(KeyboardInterrupt):
        ablate(FakeEvaluator(noise=0.0, on_evaluate=Interrupt(at=3)), space, winner, space.start,
               save=lambda records: saved.append(list(records)))
    assert [r["name"] for r in saved[-1]] == ["winner", "max_running_requests"]
    ev = FakeEvaluator(noise=0.0)
    ref, rows = ablate(ev, space, winner, space.start, done=saved[-1])
    assert len(ev.calls) == 1  # only enforce_eager's run was left
    assert ref == pytest.approx(throughput(winner)) and len(rows) == 2


def test_every_arm_is_judged_against_the_first():
    space = knob_space("cuda", BAD_START)
    arms = _arms(space, max_running_requests=1024, enforce_eager=False) | {
        "defaults": {n: k.default for n, k in space.knobs.items()}}
    c = confirm_mod.confirm(FakeEvaluator(seed=3, noise=0.01), arms, 3)
    assert [v.against for v in c.comparisons] == ["start", "defaults"]
    assert c.comparisons[0].verdict == c.verdict == "gain"
    vs_defaults = c.comparisons[1]
    assert vs_defaults.verdict in ("gain", "loss", "noise")
    assert (vs_defaults.verdict == "noise") == (abs(vs_defaults.difference)
                                                <= vs_defaults.spread)
    assert "vs start" in c.line() and "vs defaults" in c.line()
    d = c.to_dict()
    assert d["verdict"] == "gain" and [v["against"] for v in d["comparisons"]] == [
        "start", "defaults"]


def test_a_second_confirmation_keeps_the_first_ones_runs():
    space = knob_space("cuda", BAD_START)
    arms = _arms(space, max_running_requests=1024)
    saved: list = []
    confirm_mod.confirm(FakeEvaluator(), arms, 2, save=lambda r: saved.append(list(r)))
    first = saved[-1]
    other = {"best": arms["best"], "defaults": {n: k.default for n, k in space.knobs.items()}}
    ev = FakeEvaluator()
    confirm_mod.confirm(ev, other, 2, done=first, save=lambda r: saved.append(list(r)))
    assert len(ev.calls) == 2  # the best's two runs were reused, the defaults' measured
    kept = saved[-1]
    assert sum(r["arm"] == "start" for r in kept) == 2 and len(kept) == 6


def test_a_deadline_stops_before_a_run_that_would_not_fit_and_resumes():
    space = knob_space("cuda", BAD_START)
    arms = _arms(space, max_running_requests=1024)  # the fake: 10 s a run vs the start's 160
    clock, saved = FakeClock(), []
    with pytest.raises(OutOfTime, match="start's run 2"):
        confirm_mod.confirm(FakeEvaluator(clock=clock), arms, 3,
                            save=lambda r: saved.append(list(r)),
                            deadline=Deadline(200.0, clock))
    # best 10 s, start 160 s, best 10 s: 20 s left, and the start's next run takes 160
    assert [r["arm"] for r in saved[-1]] == ["best", "start", "best"]
    assert clock.now == pytest.approx(180.0)
    clock = FakeClock()
    ev = FakeEvaluator(clock=clock)
    c = confirm_mod.confirm(ev, arms, 3, done=saved[-1], deadline=Deadline(1000.0, clock))
    assert len(ev.calls) == 3 and [len(a.values) for a in c.arms] == [3, 3]
    with pytest.raises(ValueError, match="time-limit"):
        Deadline(0.0)


def test_a_deadline_stops_the_ablation_between_runs():
    space = knob_space("cuda", BAD_START)
    winner = space.complete({"max_running_requests": 1024, "enforce_eager": False})
    clock, saved = FakeClock(), []
    with pytest.raises(OutOfTime):
        ablate(FakeEvaluator(noise=0.0, clock=clock), space, winner, space.start,
               save=lambda r: saved.append(list(r)), deadline=Deadline(15.0, clock))
    assert [r["name"] for r in saved[-1]] == ["winner"] and saved[-1][0]["seconds"] == 10.0
