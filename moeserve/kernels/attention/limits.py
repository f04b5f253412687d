"""What the Triton paged attention kernels accept, torch-free: the engine config reads it to
pick the attention backend before anything is loaded (`config.resolve_static`)."""

from __future__ import annotations

PAGED_HEAD_DIMS = (16, 32, 64, 128, 256)  # a power of two: the kernels' tl.arange over D


def paged_triton_unfit(head_dim: int) -> str | None:
    """Why the Triton paged attention cannot serve heads of `head_dim`, or None."""
    if head_dim not in PAGED_HEAD_DIMS:
        return f"head_dim {head_dim} not in {PAGED_HEAD_DIMS}"
    return None
