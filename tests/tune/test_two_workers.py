"""Two tune processes on one study (one SQLite ledger): every trial is kept once, both
workers measured, and the budget is the study's, not each worker's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moeserve.tune import study as study_mod

ROOT = Path(__file__).resolve().parents[2]


def test_two_processes_share_one_study(tmp_path):
    db = tmp_path / "tune.db"
    study_mod.open_study(f"sqlite:///{db}", "shared", 0)  # created once, before the workers
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tune.worker", str(db), "shared",
                               str(i), str(tmp_path), "12"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    study = study_mod.open_study(f"sqlite:///{db}", "shared", 0)
    trials = study_mod.ledger(study)
    done = study_mod.measured(trials)
    assert 12 <= len(done) <= 13  # each worker checks the shared count before it asks
    workers = {t.user_attrs["worker"] for t in done}
    assert len(workers) == 2
    assert all(t.state.name == "COMPLETE" for t in trials)
    assert [t.number for t in study.trials] == list(range(len(study.trials)))
    assert sum(t.user_attrs["source"] == "start" for t in trials) == 1
