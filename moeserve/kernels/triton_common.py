"""What the Triton kernel modules share: where their kernels may run, and tile-size arithmetic."""

from __future__ import annotations

import os

import torch


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes are powers of two."""
    return 1 << max(0, n - 1).bit_length()


def require_triton_device(device: torch.device, who: str) -> None:
    """Raise ValueError unless a Triton kernel can run on `device`: CUDA, or any device under
    Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported; tests on CPU)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{who}: runs on CUDA tensors, or on {device.type} only under Triton's "
                         "interpreter (TRITON_INTERPRET=1 before importing triton)")
