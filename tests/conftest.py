"""Test-wide set-up: without a GPU, Triton kernels run through Triton's interpreter (the
variable must be set before anything imports triton, transformers does for one, so it is set
here, when pytest loads this file, rather than in the kernel test modules). At the end of the
run, the figures tests recorded (tests/faults/figures.py) are printed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Print the figures the tests recorded (tests/faults/figures.py), one line per entry."""
    from tests.faults.figures import FIGURES

    if FIGURES:
        terminalreporter.section("figures")
        for name, figures in FIGURES.items():
            terminalreporter.write_line(f"{name}: {json.dumps(figures)}")
