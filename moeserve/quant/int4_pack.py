"""INT4 weight-only, compressed-tensors' "pack-quantized" layout (Kimi K2-Thinking's native
format): torch references for the format and its W4A16 arithmetic.

Per linear layer of out_features N and in_features K, symmetric, group g along K (32 for Kimi):

    weight_packed  int32 [N, ceil(K / 8)]: row element i at bits 4 (i % 8) .. 4 (i % 8) + 3 of
                   word i // 8, stored as q + 8 (the signed value offset into 0..15)
    weight_scale   bf16 (or fp16 / fp32) [N, ceil(K / g)]
    weight_shape   int [2] = (N, K): the unpacked shape (K need not fill the last word)
    dequantized    W[n, k] = q[n, k] * weight_scale[n, k // g],   q in -8..7

(compressed-tensors 0.20's pack_to_int32 is the producer the tests check against.)
"""

from __future__ import annotations

import math

import torch

OFFSET = 8  # the signed 4-bit value q is stored as q + 8
PER_WORD = 8


def check_weight(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                 group: int) -> tuple[int, int]:
    """A checkpoint's INT4 tensors, or a ValueError naming the tensor; returns (N, K)."""
    if shape.numel() != 2:
        raise ValueError(f"{name}_shape: must hold (out, in), got {shape.tolist()}")
    n, k = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, math.ceil(k / PER_WORD)):
        raise ValueError(f"{name}_packed: must be int32 [{n}, {math.ceil(k / PER_WORD)}] for "
                         f"weight_shape ({n}, {k}), got {packed.dtype} {tuple(packed.shape)}")
    if not scale.dtype.is_floating_point or tuple(scale.shape) != (n, math.ceil(k / group)):
        raise ValueError(f"{name}_scale: must be floating [{n}, {math.ceil(k / group)}] "
                         f"(groups of {group}), got {scale.dtype} {tuple(scale.shape)}")
    return n, k


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, ceil(K / 8)] -> the signed values [N, K] int8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (packed[..., None] >> shifts) & 0xF  # [N, W, 8]: arithmetic shift, then mask
    return (nibbles.flatten(-2)[..., :k] - OFFSET).to(torch.int8)


def pack(q: torch.Tensor) -> torch.Tensor:
    """Signed values [N, K] in -8..7 -> int32 [N, ceil(K / 8)] (for dummy weights)."""
    if q.min() < -OFFSET or q.max() > OFFSET - 1:
        raise ValueError("INT4 values must lie in -8..7")
    n, k = q.shape
    words = math.ceil(k / PER_WORD)
    padded = torch.zeros(n, words * PER_WORD, dtype=torch.int64, device=q.device)
    padded[:, :k] = q.long() + OFFSET
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    packed = (padded.view(n, words, PER_WORD) << shifts).sum(-1)  # < 2^32: fits int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight_packed int32, weight_scale fp32 [N, ceil(K / group)]), symmetric:
    each group's largest magnitude maps to 7."""
    n, k = w.shape
    g = math.ceil(k / group)
    padded = w.float().new_zeros(n, g * group)
    padded[:, :k] = w.float()
    scale = (padded.view(n, g, group).abs().amax(-1) / (OFFSET - 1)).clamp(min=1e-12)
    q = torch.round(w.float() / scale.repeat_interleave(group, 1)[:, :k]).clamp(-OFFSET,
                                                                               OFFSET - 1)
    return pack(q.to(torch.int8)), scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized [N, K] weight in `dtype`."""
    n, k = check_weight("weight", packed, scale, shape, group)
    q = unpack(packed, k).float()
    return (q * scale.float().repeat_interleave(group, 1)[:, :k]).to(dtype)


def w4a16_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     shape: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] through an INT4 weight -> [..., N] in x's dtype (the product in fp32)."""
    w = dequantize(packed, scale, shape, group)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.shape[1]}")
    return (x.float() @ w.t()).to(x.dtype)
