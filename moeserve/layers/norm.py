"""RMSNorm, as Hugging Face's Qwen3 / Mixtral compute it.

Order of operations (matches HF exactly, so bf16 results agree bit for bit):
    x32 = x.float();  y = x32 * rsqrt(mean(x32^2, -1) + eps);  out = weight * y.to(x.dtype)
The normalisation runs in fp32; the cast back to the input dtype happens BEFORE the multiply by
the weight, which runs in the weight's dtype (the model dtype).
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (any leading shape)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device),
                                   requires_grad=False)  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
