"""The search against the fake benchmark (fake_bench.py): it finds the optimum from a bad
start within 30 trials, the doctor's proposals come first and are marked, the OOM region is
recorded as infeasible trials with their reasons, and an interrupted study resumes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moeserve.tune import study as study_mod
from moeserve.tune.space import knob_space
from tests.tune.fake_bench import (
    BAD_START,
    OOM_ABOVE,
    OPTIMUM,
    FakeEvaluator,
    Interrupt,
    throughput,
)


def _study(tmp_path, name="s", seed=0):
    return study_mod.open_study(f"sqlite:///{tmp_path / 'tune.db'}", name, seed,
                                n_startup_trials=6)


def _space():
    return knob_space("cuda", BAD_START)


def test_finds_the_optimum_within_30_trials_from_a_bad_start(tmp_path):
    study, space = _study(tmp_path), _space()
    why = study_mod.search(study, space, FakeEvaluator(seed=1), study_mod.Budget(n_trials=30))
    assert why == "trials"
    trials = study_mod.ledger(study)
    assert len(study_mod.measured(trials)) == 30
    best = study_mod.best_trial(study)
    assert throughput(best.user_attrs["params"]) >= 0.95 * OPTIMUM
    # the OOM region beside the optimum: infeasible trials, each with its reason
    oom = [t for t in trials if t.user_attrs["params"]["mem_fraction"] > OOM_ABOVE]
    assert oom, "the seeded study never tried the OOM region"
    for t in oom:
        assert t.user_attrs["failure"] == "oom"
        assert "out of memory" in t.user_attrs["error"]
        assert t.user_attrs["constraint"] > 0 and not study_mod.is_feasible(t)


def test_the_doctor_steers_first_and_its_trials_are_marked(tmp_path):
    study, space = _study(tmp_path), _space()
    ev = FakeEvaluator(seed=2)
    study_mod.search(study, space, ev, study_mod.Budget(n_trials=5))
    trials = study_mod.ledger(study)
    assert trials[0].user_attrs["source"] == "start"
    assert trials[0].user_attrs["params"] == space.start
    doctor = trials[1:5]
    assert {t.user_attrs["source"] for t in doctor} == {"doctor"}
    # one trial per verdict on the start, each moving that verdict's knob alone
    assert {t.user_attrs["rule"] for t in doctor} == {"admission_cap", "cuda_graphs",
                                                     "cpu_bound_step", "moe_tiles"}
    for t in doctor:
        moved = t.user_attrs["moved"]
        assert t.user_attrs["from_trial"] == 0
        assert {k for k, v in t.user_attrs["params"].items() if v != space.start[k]} == set(moved)
    cap = next(t for t in doctor if t.user_attrs["rule"] == "admission_cap")
    assert cap.user_attrs["moved"] == {"max_running_requests": 1024}


def test_without_the_doctor_the_sampler_proposes_every_trial(tmp_path):
    study, space = _study(tmp_path), _space()
    study_mod.search(study, space, FakeEvaluator(), study_mod.Budget(n_trials=4, doctor=False))
    sources = [t.user_attrs["source"] for t in study_mod.ledger(study)]
    assert sources[0] == "start" and set(sources[1:]) == {"sampler"}


def test_ctrl_c_keeps_the_ledger_and_the_study_resumes(tmp_path):
    space = _space()
    study = _study(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        study_mod.search(study, space, FakeEvaluator(on_evaluate=Interrupt(at=4)),
                         study_mod.Budget(n_trials=10))
    trials = study_mod.ledger(study)
    assert len(study_mod.measured(trials)) == 3
    stopped = trials[-1]
    assert stopped.user_attrs["failure"] == "interrupted" and stopped.state.name == "FAIL"
    # a new process: the same storage and name
    again = _study(tmp_path)
    why = study_mod.search(again, space, FakeEvaluator(seed=3), study_mod.Budget(n_trials=10))
    assert why == "trials"
    after = study_mod.ledger(again)
    assert len(study_mod.measured(after)) == 10
    retry = [t for t in after if t.user_attrs.get("retry_of") == stopped.number]
    assert len(retry) == 1 and retry[0].user_attrs["params"] == stopped.user_attrs["params"]
    assert [t.number for t in after[:3]] == [t.number for t in trials[:3]]  # kept, not re-run


def test_a_trial_left_running_by_a_killed_worker_is_recovered(tmp_path):
    space = _space()
    study = _study(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    trial = study.ask()
    import socket

    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead}")
    trial.set_user_attr("params", space.start)
    trial.set_user_attr("source", "start")
    events = []
    study_mod.search(study, space, FakeEvaluator(), study_mod.Budget(n_trials=2),
                     on_event=lambda kind, info: events.append((kind, info)))
    assert ("recovered", {"trials": [trial.number]}) in events
    first = study.trials[trial.number]
    assert first.state.name == "FAIL" and first.user_attrs["failure"] == "interrupted"
    retried = [t for t in study_mod.ledger(study) if t.user_attrs.get("retry_of") == trial.number]
    assert retried and retried[0].user_attrs["params"] == space.start


def test_invalid_combinations_are_infeasible_without_a_server(tmp_path):
    space = knob_space("cuda", {"async_scheduling": True})

    class Never:
        def evaluate(self, params, purpose):
            raise AssertionError("an invalid config must not be measured")

    study = _study(tmp_path)
    trial_params = space.complete({"async_scheduling": True})
    study.enqueue_trial(trial_params | {"num_continuous_decode_steps": 3},
                        user_attrs={"source": "start"})
    # the conditional knob is reset by complete(): the engine accepts the config
    assert space.check(space.complete(trial_params | {"num_continuous_decode_steps": 3}), {}) \
        is None
    assert "cannot be combined" in space.check(
        {"async_scheduling": True, "num_continuous_decode_steps": 3}, {})


def test_a_repeated_config_is_told_its_earlier_value_without_a_run(tmp_path):
    space = knob_space("cuda", {}, only=["enforce_eager"])
    ev = FakeEvaluator()
    study = _study(tmp_path)
    why = study_mod.search(study, space, ev, study_mod.Budget(n_trials=5, doctor=False))
    assert why == "exhausted"  # two configs only
    assert len(ev.calls) == 2
    dups = [t for t in study_mod.ledger(study) if "duplicate_of" in t.user_attrs]
    assert dups and all(t.value == study.trials[t.user_attrs["duplicate_of"]].value
                        for t in dups)


def test_a_resumed_study_draws_new_configs_not_the_first_calls_again(tmp_path):
    space = _space()
    study = _study(tmp_path)
    study_mod.search(study, space, FakeEvaluator(), study_mod.Budget(n_trials=4, doctor=False))
    first = study_mod.ledger(study)
    again = _study(tmp_path)  # a new call: the same storage, name and seed
    study_mod.search(again, space, FakeEvaluator(), study_mod.Budget(n_trials=8, doctor=False))
    after = study_mod.ledger(again)
    assert len(study_mod.measured(after)) == 8
    assert not [t.number for t in after if "duplicate_of" in t.user_attrs]
    seen = {repr(sorted(t.user_attrs["params"].items())) for t in first}
    assert all(repr(sorted(t.user_attrs["params"].items())) not in seen for t in after[4:])
