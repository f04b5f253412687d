"""The call's time limit for the confirmation and the ablation (`--time-limit`).

    Deadline(seconds, clock=time.monotonic)
    deadline.check(what, estimate)  raise OutOfTime when a run of `estimate` seconds, started
                                    now, would end past the limit
    estimate(records, same=...)     the longest earlier run among `records` that `same` picks
                                    (else the longest of all; None when there is none)

A confirmation run on a slow arm (the seeds' bad start: minutes a run) that a machine's
command limit cuts is lost whole; the deadline stops before it instead, with the ledger
holding every finished run, so that the next call resumes there. A run with no estimate
(nothing measured yet) always starts. The clock is injected, so tests never sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any


class OutOfTime(Exception):
    """The next run would not end inside --time-limit; the ledger holds what was done."""


class Deadline:
    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"--time-limit must be > 0 seconds, got {seconds}")
        self.clock = clock
        self.at = None if seconds is None else clock() + seconds

    def left(self) -> float | None:
        return None if self.at is None else self.at - self.clock()

    def check(self, what: str, estimate: float | None) -> None:
        left = self.left()
        if left is None or estimate is None:
            return
        if estimate > left:
            raise OutOfTime(f"{what} would take about {estimate:,.0f} s, {max(left, 0):,.0f} s "
                            "are left of --time-limit")


def estimate(records: Iterable[Mapping[str, Any]],
             same: Callable[[Mapping[str, Any]], bool] = lambda r: True) -> float | None:
    """Seconds the next run may take: the longest earlier run that `same` picks, else the
    longest earlier run of any kind (a first run of a new config is guessed from the others)."""
    timed = [r for r in records if r.get("seconds")]
    for pool in ([r for r in timed if same(r)], timed):
        if pool:
            return max(float(r["seconds"]) for r in pool)
    return None
