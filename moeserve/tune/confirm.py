"""Confirmation: is the best config's gain real, or noise?

    confirm(evaluator, arms, runs, deadline=None) -> Confirmation

The arms (the best config and the start config, and the engine's defaults; the first is
judged against each of the others) run in turn, A B [C] A B [C] ..., `runs` times each, every run on
a fresh server with the full workload (evaluator purpose "confirm"), so that drift of the
machine over the call lands on every arm alike. Per arm: each value, the mean, and the spread
(max - min). The gain of the first arm over the second is called real only when the
difference of the means exceeds the larger of the two arms' spreads; inside it, the verdict
is "noise". A failed run is kept with its failure and
left out of the means. With a `deadline`, a run that its arm's earlier runs say would end past
it is not started: OutOfTime, with every finished run saved for the next call.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from moeserve.tune.deadline import Deadline, estimate
from moeserve.tune.evaluate import Evaluator, Outcome


@dataclass(slots=True)
class Arm:
    name: str
    params: dict[str, Any]
    values: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    runs: list[list[dict[str, Any]]] = field(default_factory=list)  # figures of each run

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def spread(self) -> float:
        return max(self.values) - min(self.values) if len(self.values) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"mean": self.mean, "spread": self.spread}


@dataclass(frozen=True, slots=True)
class Comparison:
    """The first arm judged against one other."""

    against: str
    gain: float | None  # mean first / mean other - 1
    difference: float | None  # mean first - mean other, tok/s
    spread: float  # the larger arm spread, tok/s
    verdict: str  # "gain", "loss", "noise" or "unknown" (an arm without a value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Confirmation:
    arms: list[Arm]
    comparisons: list[Comparison]  # the first arm against the second, third, ...

    @property
    def verdict(self) -> str:  # against the second arm (the start)
        return self.comparisons[0].verdict

    @property
    def gain(self) -> float | None:
        return self.comparisons[0].gain

    @property
    def difference(self) -> float | None:
        return self.comparisons[0].difference

    @property
    def spread(self) -> float:
        return self.comparisons[0].spread

    def to_dict(self) -> dict[str, Any]:
        first = self.comparisons[0]
        return {"arms": [a.to_dict() for a in self.arms], "gain": first.gain,
                "difference": first.difference, "spread": first.spread,
                "verdict": first.verdict,
                "comparisons": [c.to_dict() for c in self.comparisons]}

    def line(self) -> str:
        best = self.arms[0]
        if best.mean is None:
            return "confirmation: the first arm has no successful run (see the failures)"
        out = []
        for c, other in zip(self.comparisons, self.arms[1:], strict=True):
            if c.verdict == "unknown":
                out.append(f"vs {other.name}: no successful run (see the failures)")
                continue
            out.append(f"vs {other.name} {other.mean:,.0f} (spread {other.spread:,.0f}, "
                       f"{len(other.values)} runs): {c.gain:+.1%}, " + (
                           "a real gain" if c.verdict == "gain" else
                           "a real loss" if c.verdict == "loss" else
                           f"noise (the difference {c.difference:+,.0f} is inside the spread "
                           f"{c.spread:,.0f})"))
        return (f"confirmation: {best.name} {best.mean:,.0f} tok/s (spread {best.spread:,.0f}, "
                f"{len(best.values)} runs) " + "; ".join(out))


def judge(best: Arm, start: Arm) -> tuple[float | None, float | None, float, str]:
    """(gain, difference, spread, verdict) of two arms."""
    spread = max(best.spread, start.spread)
    if best.mean is None or start.mean is None or start.mean <= 0:
        return None, None, spread, "unknown"
    diff = best.mean - start.mean
    verdict = "noise" if abs(diff) <= spread else "gain" if diff > 0 else "loss"
    return best.mean / start.mean - 1.0, diff, spread, verdict


def confirm(evaluator: Evaluator, arms: Mapping[str, Mapping[str, Any]], runs: int = 3,
            on_run: Callable[[str, int, Outcome], None] | None = None,
            done: list[dict[str, Any]] | None = None,
            save: Callable[[list[dict[str, Any]]], None] | None = None,
            deadline: Deadline | None = None) -> Confirmation:
    """`arms`: name -> config, the best first and the start second (then any others).

    Resumable: `done` holds the records of runs made before (arm, round, value, failure,
    runs, seconds; what `save` was given after each run), which are taken as they are when
    their arm's config is the same; records of other arms or configs are kept as they are.
    A call interrupted between runs loses only the run in progress."""
    if runs < 1:
        raise ValueError(f"confirmation runs must be >= 1, got {runs}")
    if len(arms) < 2:
        raise ValueError("confirmation needs the best and the start config")
    state = [Arm(name, dict(params)) for name, params in arms.items()]
    def ours(r: Mapping[str, Any]) -> bool:
        return r.get("arm") in arms and r.get("params") == dict(arms[r["arm"]])

    others = [r for r in done or [] if not ours(r)]
    records = [r for r in done or [] if ours(r)]
    for i in range(runs):
        for arm in state:
            rec = next((r for r in records if r["arm"] == arm.name and r["round"] == i), None)
            if rec is None:
                if deadline is not None:
                    deadline.check(f"{arm.name}'s run {i + 1}",
                                   estimate(records, lambda r, a=arm.name: r["arm"] == a))
                out = evaluator.evaluate(arm.params, "confirm")
                rec = {"arm": arm.name, "round": i, "params": arm.params, "value": out.value,
                       "failure": out.failure, "error": out.error, "runs": out.runs,
                       "seconds": out.seconds}
                records.append(rec)
                if save is not None:
                    save(others + records)
                if on_run is not None:
                    on_run(arm.name, i, out)
            arm.runs.append(rec["runs"])
            if rec["value"] is not None and rec["failure"] is None:
                arm.values.append(rec["value"])
            else:
                arm.failures.append(f"{rec['failure']}: {rec['error']}")
    return Confirmation(state, [Comparison(o.name, *judge(state[0], o)) for o in state[1:]])
