"""A doctor's verdict: what one rule found in a run, the figures it used, the knob to turn.

    Verdict(rule, severity, message, knob, evidence, settings)
        severity   "critical" | "warning" | "info" (SEVERITIES, most severe first)
        knob       the fix in words, with its flags (`--max-running-requests 1024`)
        evidence   the figures the rule used, under their names
        settings   the same fix for a tuner: engine config fields (config.py's flat names, as
                   engine_config_from_kwargs takes them) -> proposed values; {} when no engine
                   field is the fix

to_dict / from_dict round-trip it through a run's JSON line (a dict without settings loads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True, slots=True)
class Verdict:
    rule: str
    severity: str  # one of SEVERITIES
    message: str
    knob: str
    evidence: dict[str, Any] = field(default_factory=dict)
    # engine config fields (config.py's flat names) -> the values the rule proposes
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"verdict severity must be one of {SEVERITIES}, "
                             f"got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(d["rule"], d["severity"], d["message"], d["knob"], dict(d.get("evidence", {})),
                   dict(d.get("settings", {})))


def rounded(x: float | None, nd: int = 3) -> float | None:
    """A figure for evidence: rounded to `nd` places (None stays None)."""
    return None if x is None else round(float(x), nd)


def as_flags(settings: dict[str, Any]) -> str:
    """Settings as the command line's flags: {"enforce_eager": False, "torch_threads": 2} ->
    "--no-enforce-eager --torch-threads 2" (engine/args.py's flag names)."""
    flags = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag} {value}")
    return " ".join(flags)
