"""RMSNorm, as Hugging Face's Qwen3 / Mixtral compute it, optionally fused with the residual add.

Order of operations (matches HF exactly, so bf16 results agree bit for bit on CPU):
    x32 = x.float();  y = x32 * rsqrt(mean(x32^2, -1) + eps);  out = weight * y.to(x.dtype)
The normalisation runs in fp32; the cast back to the input dtype happens BEFORE the multiply by
the weight, which runs in the weight's dtype (the model dtype).

`forward(x, residual)` (vLLM's pattern) first forms s = residual + x in the model dtype, as HF's
`hidden = residual + hidden`, and returns (norm(s), s): s is the next residual. x may be [T, S,
dim] parts with residual [T, dim] (a sparse MoE layer's k weighted expert rows): x.sum(1) is
then the x added.

On CUDA both run as one Triton kernel (kernels/norm_rope/rmsnorm_triton.py: the same ops, up to the
order of the fp32 sum of squares); elsewhere the torch reference runs (bit for bit HF's ops).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.kernels.norm_rope.rmsnorm_triton import rms_norm_ref, rms_norm_triton
from moeserve.layers.params import empty_param


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (any leading shape)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype, device=device)  # [dim]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> out [..., dim]; with residual (x's shape and dtype) ->
        (norm(residual + x), residual + x); x [T, S, dim] with residual [T, dim] adds x.sum(1)."""
        if x.is_cuda:
            return rms_norm_triton(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias over the last dimension, in the input's dtype (as
    torch's nn.LayerNorm, which HF's DSA indexer uses for its keys)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype, device=device)  # [dim]
        self.bias = empty_param(dim, dtype=dtype, device=device)  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
