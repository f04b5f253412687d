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
    # what every trial was, so that a failure (seen once, on a loaded machine) says why
    seen = [(t.number, t.state.name, {k: t.user_attrs.get(k) for k in
                                      ("worker", "source", "failure", "duplicate_of")})
            for t in study.trials]
    assert 12 <= len(done) <= 13, seen  # each worker checks the shared count before it asks
    workers = {t.user_attrs["worker"] for t in done}
    assert len(workers) == 2, seen
    assert all(t.state.name == "COMPLETE" for t in trials), seen
    assert [t.number for t in study.trials] == list(range(len(study.trials))), seen
    assert sum(t.user_attrs["source"] == "start" for t in trials) == 1, seen


def test_two_workers_starting_at_once_queue_the_start_once(tmp_path, monkeypatch):
    """The check and the enqueue of the start config are one step under the ledger's lock:
    with the check slowed down so that two workers overlap in it, the start is queued once."""
    import threading

    from moeserve.tune.space import knob_space
    from tests.tune.fake_bench import BAD_START

    url = f"sqlite:///{tmp_path / 'tune.db'}"
    study_mod.open_study(url, "race", 0)
    tried = study_mod._tried
    inside = threading.Barrier(2, timeout=5)

    def slow_tried(study):
        seen = tried(study)
        try:  # both threads wait here, having read the ledger, when they can be inside together
            inside.wait()
        except threading.BrokenBarrierError:
            pass  # the lock kept the other one out: the barrier times out, as it should
        return seen

    monkeypatch.setattr(study_mod, "_tried", slow_tried)
    space = knob_space("cuda", BAD_START)
    workers = [threading.Thread(target=study_mod._enqueue_start,
                                args=(study_mod.open_study(url, "race", 0), space))
               for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    study = study_mod.open_study(url, "race", 0)
    assert sum(t.user_attrs.get("source") == "start" for t in study.get_trials()) == 1
