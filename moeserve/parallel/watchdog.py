"""The step deadline over the ranks: each rank's heartbeat, and rank 0's watchdog.

Collectives captured in CUDA graphs are not watched by the process group's timeout, and a rank
stopped mid-step leaves the others waiting inside a collective, so the engine keeps its own
deadline (`step_timeout_s`):

    every worker    a thread writes "<beat> <steps done>" to the store key beat/<rank> each
                    BEAT_PERIOD_S (a stopped or dead process stops beating)
    rank 0          `Watchdog.check` (its thread calls it each CHECK_PERIOD_S) sees how long
                    the call in flight has run; past the deadline it names the ranks that
                    failed: those whose beat stopped (dead or stopped), else those with the
                    fewest steps done (hung in a kernel), else, when no rank has gone silent
                    within SILENT_AFTER_S more, rank 0 itself, and calls
                    `on_fire(message)` once (the executor kills the local workers, which ends
                    rank 0's own wait in the collective, and exits if that wait does not end)

The clock is injected, so the naming logic is tested without waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

BEAT_PERIOD_S = 0.5
CHECK_PERIOD_S = 0.25
SILENT_AFTER_S = 6 * BEAT_PERIOD_S  # a beat unchanged this long: the rank is not running


def beat_key(rank: int) -> str:
    return f"moeserve/beat/{rank}"


class Heartbeat:
    """A worker's beat: `steps` is set by the worker loop, the thread publishes it."""

    def __init__(self, store: dist.Store, rank: int, period_s: float = BEAT_PERIOD_S):
        self.store, self.rank, self.period_s = store, rank, period_s
        self.steps = 0
        self._beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"moeserve-beat-{rank}",
                                        daemon=True)

    def start(self) -> Heartbeat:
        self.publish()
        self._thread.start()
        return self

    def publish(self) -> None:
        self._beat += 1
        self.store.set(beat_key(self.rank), f"{self._beat} {self.steps}")

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.publish()
            except Exception:  # the store is gone: the engine is ending
                return


class Watchdog:
    """Rank 0's deadline on each call it runs over the ranks (see the module doc)."""

    def __init__(self, read_beat: Callable[[int], str | None], world_size: int,
                 timeout_s: float, on_fire: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.read_beat, self.world_size, self.timeout_s = read_beat, world_size, timeout_s
        self.on_fire, self.clock = on_fire, clock
        self.fired: str | None = None  # the message, once fired
        self._call: tuple[str, float] | None = None  # (what, since)
        self._seen: dict[int, tuple[str | None, float]] = {}  # rank -> (beat, when it changed)
        self._stop = threading.Event()

    @classmethod
    def over_store(cls, store: dist.Store, world_size: int, timeout_s: float,
                   on_fire: Callable[[str], None]) -> Watchdog:
        def read(rank: int) -> str | None:
            try:
                return store.get(beat_key(rank)).decode() if store.check([beat_key(rank)]) \
                    else None
            except Exception:
                return None
        return cls(read, world_size, timeout_s, on_fire)

    def begin(self, what: str) -> None:
        self._call = (what, self.clock())

    def end(self) -> None:
        self._call = None

    def check(self) -> str | None:
        """Sample the beats; past the deadline name the failed ranks and fire (once)."""
        now = self.clock()
        beats: dict[int, str | None] = {}
        for rank in range(1, self.world_size):
            beat = self.read_beat(rank)
            beats[rank] = beat
            if rank not in self._seen or self._seen[rank][0] != beat:
                self._seen[rank] = (beat, now)
        call = self._call
        if self.fired is not None or call is None or now - call[1] <= self.timeout_s:
            return None
        what = call[0]
        silent = [r for r in beats if now - self._seen[r][1] > SILENT_AFTER_S]
        steps = {r: int(b.split()[1]) for r, b in beats.items() if b is not None}
        fewest = min(steps.values(), default=None)
        laggards = [r for r, s in steps.items() if s == fewest and fewest < max(steps.values())]
        if silent:
            who = ", ".join(f"rank {r}" for r in silent)
            why = "stopped beating (dead, stopped or cut off)"
        elif laggards:
            who, why = ", ".join(f"rank {r}" for r in laggards), "did not finish its step"
        elif now - call[1] <= self.timeout_s + SILENT_AFTER_S:
            return None  # a rank stopped just now is not silent long enough to tell yet
        else:
            who, why = "rank 0", "(the engine's own rank) is stuck"
        self.fired = (f"{who} {why}: {what} ran past the step deadline of "
                      f"{self.timeout_s:g} s (step_timeout_s)")
        self.on_fire(self.fired)
        return self.fired

    def start(self, period_s: float = CHECK_PERIOD_S) -> Watchdog:
        def run() -> None:
            while not self._stop.wait(period_s) and self.fired is None:
                self.check()
        threading.Thread(target=run, name="moeserve-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
