"""Test-wide set-up: without a GPU, Triton kernels run through Triton's interpreter; the fault
suite's figures are printed at the end of the run.

The variable must be set before anything imports triton (transformers does, for one), so it is
set here, when pytest loads this file, rather than in the kernel test modules.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter: object) -> None:
    """The fault suite's figures (tests/faults/figures.py), at the end of the CI log."""
    from tests.faults.figures import FIGURES

    if not FIGURES:
        return
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    terminalreporter.section("fault suite figures")  # type: ignore[attr-defined]
    for name, figures in FIGURES.items():
        write(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
