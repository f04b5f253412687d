"""Fixtures the kernel tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


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
