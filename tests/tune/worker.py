"""One tune worker for test_two_workers: `python -m tests.tune.worker DB NAME ID DIR N`.

It searches the shared study with the fake benchmark. In its first measurement it announces
itself in DIR (a file per worker) and waits until every worker has: so each worker holds a
trial of its own whatever each process's start-up time."""

from __future__ import annotations

import sys
from pathlib import Path

from moeserve.tune import study as study_mod
from moeserve.tune.space import knob_space
from tests.tune.fake_bench import BAD_START, FakeEvaluator
from tests.wait import wait_until


def main() -> None:
    db, name, wid, folder, n = sys.argv[1:6]
    folder_p = Path(folder)

    def barrier(count, params):
        if count == 1:
            (folder_p / f"worker{wid}").write_text("here")
            wait_until(lambda: len(list(folder_p.glob("worker*"))) == 2, timeout_s=120,
                       what="both workers")

    study = study_mod.open_study(f"sqlite:///{db}", name, seed=int(wid), n_startup_trials=4)
    study_mod.search(study, knob_space("cuda", BAD_START), FakeEvaluator(seed=int(wid),
                     on_evaluate=barrier), study_mod.Budget(n_trials=int(n)))


if __name__ == "__main__":
    main()
