"""Rotary position embedding (default RoPE, neox style: rotate_half), as Hugging Face computes it.

    inv_freq[i] = 1 / theta ** (arange(0, R, 2) / R)              fp32, HF's exact expression
    freqs[p, i] = p * inv_freq[i];  emb = cat(freqs, freqs)        [max_position, R] fp32
    cos, sin    = emb.cos(), emb.sin()   (cast to q's dtype at use, as HF does)
    q' = q * cos + rotate_half(q) * sin,   rotate_half(x) = cat(-x[..., R/2:], x[..., :R/2])

R is the rotary dim: the head_dim D by default; R < D is partial rotary (GLM-4.5), where only
the first R dims of each head rotate and the rest pass through (the kernels read R from the
tables' width).

YaRN (`rope` given with rope_type "yarn"): inv_freq and the cos/sin factor come from
layers/rope_scaling.py (transformers' init); the tables carry the factor, so the kernels need
nothing of their own.

The cos/sin table is computed once per (rotary_dim, max_position, theta or rope, device) and
shared by every layer (48 layers must not hold 48 copies of a 131k-position table).

On CUDA, q and k are rotated in one Triton launch (kernels/norm_rope/rope_triton.py, bit for bit the
same ops and roundings); elsewhere the torch reference runs. The attention layer on CUDA reads only
the tables: kernels/attention/qk_rope_kv_triton.py fuses RoPE with the q/k norm and the KV write.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from moeserve.kernels.norm_rope.rope_triton import rope_ref, rope_triton
from moeserve.layers.rope_scaling import inv_freq_and_factor
from moeserve.model_config import RopeConfig


@functools.lru_cache(maxsize=8)
def _cos_sin_table(rotary_dim: int, max_position: int, theta: float, device: torch.device,
                   rope: RopeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, rotary_dim] fp32 (rotary_dim: the head_dim for full RoPE)."""
    factor = 1.0
    if rope is not None and rope.rope_type != "default":
        inv_freq, factor = inv_freq_and_factor(rope, rotary_dim)
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float)
                                    / rotary_dim))
    pos = torch.arange(max_position, dtype=torch.float)  # [P]
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    if factor != 1.0:
        return (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)
    return emb.cos().to(device), emb.sin().to(device)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, KVH, D] at `positions` [T] (int64)."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 device: torch.device | str | None = None, rotary_dim: int | None = None,
                 rope: RopeConfig | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"RoPE needs an even rotary_dim in (0, head_dim {head_dim}], got "
                             f"{rotary_dim}")
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.rotary_dim = rotary_dim
        # NOTE: plain attributes, not buffers: shared across layers and kept out of state_dict.
        self.cos, self.sin = _cos_sin_table(rotary_dim, max_position, float(theta),
                                            torch.device(device or "cpu"), rope)  # [P, R] fp32

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] (strided views allowed) -> new (q', k'), same shapes."""
        if q.is_cuda:
            return rope_triton(positions, q, k, self.cos, self.sin)
        return rope_ref(positions, q, k, self.cos, self.sin)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.max_position}, theta={self.theta}")
