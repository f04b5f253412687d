"""Figures the fault tests record, printed at the end of the run (tests/conftest.py's
pytest_terminal_summary), so the CI log shows what was exercised, not only that it passed.

    FIGURES["schemathesis"] = {"cases": ..., "failures": ..., "checks": {...}, ...}
"""

from __future__ import annotations

from typing import Any

FIGURES: dict[str, dict[str, Any]] = {}


def record(name: str, **figures: Any) -> None:
    """Keep one test's figures under its name (a later call with the same name adds to them)."""
    FIGURES.setdefault(name, {}).update(figures)
