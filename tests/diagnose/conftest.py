from __future__ import annotations

import pytest

from moeserve.bench.diagnostics import RunDiagnostics
from tests.wait import wait_until


@pytest.fixture
def first_sample_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RunDiagnostics.start()` returns once the engine timeline has its first sample (or a
    failed one), so that a bench run's timeline surely holds a sample from before the run as
    well as the end-of-run one, however slowly the sampler thread gets going."""
    start = RunDiagnostics.start

    def start_and_wait(self: RunDiagnostics) -> None:
        start(self)
        if self.timeline is not None:
            timeline = self.timeline
            wait_until(lambda: timeline.rows or timeline.errors, "the first engine sample")

    monkeypatch.setattr(RunDiagnostics, "start", start_and_wait)
