"""What the fault suite measured, printed at the end of the run (tests/conftest.py's
pytest_terminal_summary): the fault suite's figures belong in the CI log."""

from __future__ import annotations

from typing import Any

FIGURES: dict[str, dict[str, Any]] = {}


def record(name: str, **figures: Any) -> None:
    """Keep one test's figures under its name (a later call with the same name adds to them)."""
    FIGURES.setdefault(name, {}).update(figures)
