"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)) with gate and up fused into one weight.

    gate_up_proj [2I, hidden]: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
    down_proj    [hidden, I]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)  # [T, I] each
        return linear(F.silu(gate) * up, self.down_proj)  # [T, hidden]
