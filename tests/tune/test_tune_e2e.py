"""`moeserve tune` end to end on CPU: tiny-moe, a real server per trial, the real bench.

A few trials from a start with the admission cap at 1 while the bench keeps 4 in flight; then
the confirmation, the ablation and the report. What is asserted is what the tool wrote (the
ledger, the report), never how fast anything ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moeserve.tune import study as study_mod

ROOT = Path(__file__).resolve().parents[2]


def _tune(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moeserve.cli", "tune", "--preset", "tiny-moe",
           "--max-concurrency", "4", "--trial-prompts", "12", "--confirm-prompts", "12",
           "--bench-args", "--input-len 16 --output-len 16",
           "--server-args", "--torch-threads 1",
           "--start", "--max-running-requests 1",
           "--knobs", "max_running_requests,num_continuous_decode_steps",
           "--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--study-name", "e2e",
           "--out", str(tmp_path / "out"), *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_tune_on_tiny_moe_against_real_servers(tmp_path):
    res = _tune(tmp_path, "--n-trials", "3", "--confirm-runs", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    study = study_mod.open_study(f"sqlite:///{tmp_path / 'tune.db'}", "e2e")
    trials = study_mod.ledger(study)
    assert len(study_mod.measured(trials)) == 3
    start = trials[0]
    assert start.user_attrs["source"] == "start"
    assert start.user_attrs["params"]["max_running_requests"] == 1
    assert "--max-running-requests 1" in start.user_attrs["command"]
    for t in trials:  # every figure of the bench, the capacity report, the verdicts
        assert t.user_attrs["failure"] is None, t.user_attrs["error"]
        run = t.user_attrs["runs"][0]
        assert run["completed"] == 12 and run["output_throughput"] > 0
        assert t.user_attrs["capacity"]["engine_config"]["scheduler"]["max_running_requests"] \
            == t.user_attrs["params"]["max_running_requests"]
        assert isinstance(t.user_attrs["verdicts"], list)
    rules = {v["rule"] for v in start.user_attrs["verdicts"]}
    if "admission_cap" in rules:  # the cap bound in the sampled timeline: the doctor moves it
        doctor = [t for t in trials if t.user_attrs["source"] == "doctor"]
        assert doctor and doctor[0].user_attrs["rule"] in rules
    conf = study.user_attrs["confirmations"]["best vs start"]
    assert [a["name"] for a in conf["arms"]] == ["best", "start"]
    assert conf["verdict"] in ("gain", "loss", "noise")
    assert "ablation" in study.user_attrs
    out = tmp_path / "out"
    summary = json.loads((out / "tune.json").read_text())
    assert summary["best"]["command"].startswith("moeserve serve --model tiny-moe")
    assert (out / "history.png").stat().st_size > 0 and (out / "knobs.png").exists()
    md = (out / "tune.md").read_text()
    assert "## Winner" in md and "## Confirmation: best vs start" in md
    assert "winner (trial" in res.stdout
    # a second call resumes: the budget is the study's
    again = _tune(tmp_path, "--n-trials", "4", "--phases", "search")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "study 'e2e'" in again.stdout and "3 trials so far" in again.stdout
    assert len(study_mod.measured(study_mod.ledger(study))) == 4
    # a report of a ledger made anywhere: its setup from the ledger, no server started
    rep = subprocess.run([sys.executable, "-m", "moeserve.cli", "tune", "--phases", "report",
                          "--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--study-name",
                          "e2e", "--out", str(tmp_path / "again")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "4 measured trials" in (tmp_path / "again" / "tune.md").read_text()


def test_a_server_that_cannot_start_is_an_infeasible_trial(tmp_path):
    res = _tune(tmp_path, "--n-trials", "1", "--phases", "search,report",
                "--server-args", "--torch-threads 1 --num-blocks 2")
    # two KV blocks cannot hold a 32-token request: start-up or every request fails; either
    # way the trial is infeasible with its reason, and the tune ends cleanly (no feasible one)
    assert res.returncode == 1, res.stdout + res.stderr
    study = study_mod.open_study(f"sqlite:///{tmp_path / 'tune.db'}", "e2e")
    (t,) = study_mod.ledger(study)
    assert t.user_attrs["failure"] in ("startup", "failed") and t.user_attrs["error"]
    assert "no feasible trial" in res.stdout


def test_bad_flags_are_named_before_anything_runs(tmp_path):
    from moeserve.tune.cli import run_tune

    base = ["--preset", "tiny-moe", "--storage", f"sqlite:///{tmp_path / 'x.db'}"]
    cases = {"--bench-args": ["--bench-args", "--num-prompts 5"],
             "--start": ["--start", "--no-such-flag 1"],
             "--phases": ["--phases", "search,tidy"],
             "--knobs": ["--knobs", "enforce_eager"],  # a CUDA knob, on a CPU study
             "--max-concurrency": ["--max-concurrency", "many"],
             "--trial-prompts": ["--trial-prompts", "0x"]}
    for flag, extra in cases.items():
        assert run_tune(base + extra) == 2, flag
    assert not (tmp_path / "x.db").exists()  # no study was made for a bad command
