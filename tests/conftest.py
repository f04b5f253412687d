"""Test-wide set-up: without a GPU, Triton kernels run through Triton's interpreter (the
variable must be set before anything imports triton, transformers does for one, so it is set
here, when pytest loads this file, rather than in the kernel test modules); `no_tf32` for fp32
expectations on the GPU; in a pytest-xdist worker, torch's CPU threads its share of the cores.
At the end of the run, the figures tests recorded (tests/faults/figures.py) are printed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores() -> None:
    """In a pytest-xdist worker, torch's CPU ops get this worker's share of the usable cores
    (at least one thread), not every core each: N workers with a pool of all the cores apiece
    oversubscribe the machine (CI: 2 workers on 2 cores; the GPU machine: 14 on 16)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


_share_the_cores()


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """fp32 expectations computed in true fp32 (not TF32). Set and restored by hand: torch's
    cuBLAS flags are properties of its backend module, which monkeypatch cannot save."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Print the figures the tests recorded (tests/faults/figures.py), one line per entry."""
    from tests.faults.figures import FIGURES

    if FIGURES:
        terminalreporter.section("figures")
        for name, figures in FIGURES.items():
            terminalreporter.write_line(f"{name}: {json.dumps(figures)}")
