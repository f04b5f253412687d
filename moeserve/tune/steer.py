"""The doctor steers first: its verdicts on the best trial so far become the next trials.

    proposals(space, best_params, verdicts, tried) -> [Proposal]
    combination(space, base_params, gained, tried) -> Proposal | None

Each verdict that names settings (doctor.Verdict.settings: config field -> value, e.g.
admission_cap -> {"max_running_requests": 1024}) proposes the best config with those knobs
moved, as the seeds' engineer changed one knob after reading the logs. A setting is snapped onto
the knob's values (space.snap); a knob the study does not search (fixed, or not on this device)
is skipped with the reason; a config already tried (or queued) is not proposed again. The study
enqueues the proposals as trials marked "doctor" with the verdict that proposed them, so the
report can say what the doctor's trials gained apart from what the sampler found.

When two or more of one round's moves (proposals from the same trial) each beat that trial,
the next doctor trial makes them together ("combined"), as the engineer kept each finding and
went on from there: a round of k verdicts costs k + 1 trials, not k + (k-1) + ... .
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moeserve.tune.space import Space


@dataclass(frozen=True, slots=True)
class Proposal:
    params: dict[str, Any]
    rule: str
    moved: dict[str, Any]  # the knobs the verdict moved, with their new values
    message: str
    skipped: dict[str, str] = field(default_factory=dict)  # setting -> why it was not applied


def config_key(params: Mapping[str, Any]) -> tuple:
    """A hashable identity of a complete config (for "already tried")."""
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def proposals(space: Space, best: Mapping[str, Any], verdicts: Iterable[Mapping[str, Any]],
              tried: set[tuple]) -> list[Proposal]:
    """The doctor's next trials from `verdicts` (dicts of doctor.Verdict) on the config
    `best`, most severe verdict first, without configs in `tried` (config_key values)."""
    out: list[Proposal] = []
    seen = set(tried)
    for v in verdicts:
        settings = v.get("settings") or {}
        moved: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for name, value in settings.items():
            if name not in space.knobs:
                skipped[name] = "not searched in this study (fixed, or not on this device)"
                continue
            try:
                moved[name] = space.snap(name, value)
            except ValueError as e:
                skipped[name] = str(e)
        if not moved:
            continue
        params = space.complete({**best, **moved})
        key = config_key(params)
        if key in seen:
            continue
        seen.add(key)
        out.append(Proposal(params, str(v.get("rule")), moved, str(v.get("message", "")),
                            skipped))
    return out


def combination(space: Space, base: Mapping[str, Any], gained: list[tuple[str, dict[str, Any]]],
                tried: set[tuple]) -> Proposal | None:
    """The moves of `gained` ((rule, moved) of the round's trials that beat `base`) together,
    or None when fewer than two gained or that config was tried."""
    if len(gained) < 2:
        return None
    moved: dict[str, Any] = {}
    for _, m in gained:
        moved.update(m)
    params = space.complete({**base, **moved})
    if config_key(params) in tried:
        return None
    rules = " + ".join(rule for rule, _ in gained)
    return Proposal(params, f"combined: {rules}", moved, f"the moves that each gained: {rules}")
