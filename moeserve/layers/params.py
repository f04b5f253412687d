"""The one way layers declare an inference weight."""

from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype | None,
                device: torch.device | str | None) -> nn.Parameter:
    """An uninitialised inference weight (filled by the weight loader or init_dummy_weights)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
