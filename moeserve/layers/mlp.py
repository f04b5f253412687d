"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)) with gate and up fused into one weight; on
CUDA the activation is one Triton launch (kernels/activation/silu_mul_triton.py).

    gate_up_proj [2I, hidden]: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
    down_proj    [hidden, I]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.activation.silu_mul_triton import silu_mul_triton
from moeserve.layers.linear import WeightFactory, linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 weights: WeightFactory | None = None) -> None:
        super().__init__()
        weights = weights or WeightFactory()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = weights.linear("gate_up_proj", 2 * intermediate_size, hidden_size,
                                           dtype=dtype, device=device)
        self.down_proj = weights.linear("down_proj", hidden_size, intermediate_size,
                                        dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.activation(x), self.down_proj)  # [T, hidden]

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> silu(gate(x)) * up(x) [T, I], down_proj's input."""
        gate_up = linear(x, self.gate_up_proj)  # [T, 2I]
        if gate_up.is_cuda:  # one launch, the same bits as the two ops below
            return silu_mul_triton(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up
