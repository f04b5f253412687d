"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)) with gate and up fused into one weight.

    gate_up_proj [2I, hidden]: rows [0, I) are gate_proj, rows [I, 2I) are up_proj
    down_proj    [hidden, I]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.params import empty_param


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_param(2 * intermediate_size, hidden_size, dtype=dtype,
                                        device=device)
        self.down_proj = empty_param(hidden_size, intermediate_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)  # [T, I] each
        return F.linear(F.silu(gate) * up, self.down_proj)  # [T, hidden]
