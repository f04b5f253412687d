"""FP8 block-scaled weights (DeepSeek-V3's layout, many GLM and Qwen3 FP8 releases): torch
references for the format and its W8A8 arithmetic.

Per linear layer of out_features N and in_features K, block (bn, bk) = (128, 128):

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)]     (the partial last blocks included)
    dequantized       W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]

(the name says "inverse" because it undoes the quantizer's division). Activations are quantized
at run time, per token and bk-wide group of K (dynamic): x_q = e4m3(x / s), s = amax / 448, and
the W8A8 product sums each K block's exact e4m3 products times both scales:

    out[t, n] = sum_kb  s_x[t, kb] * s_w[n // bn, kb] * sum_{k in kb} x_q[t, k] * w_q[n, k]

`w8a8_linear_ref` computes exactly that in fp32 (dequantize both sides, then one matmul: the
same sum up to fp32 order); the Triton kernel (GPU) must match it. `quantize_blockwise` makes
weights in this layout (dummy weights, tests).
"""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value
BLOCK = (128, 128)
_MIN_SCALE = 1e-12  # an all-zero block or group keeps a finite, tiny scale


def scale_shape(n: int, k: int, block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """weight_scale_inv's shape for an [n, k] weight: one scale per block, partial ones too."""
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def check_weight(name: str, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block: tuple[int, int] = BLOCK) -> None:
    """A checkpoint's FP8 weight and its scales, or a ValueError naming the tensor."""
    if weight.dtype != E4M3:
        raise ValueError(f"{name}: FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: FP8 weight must be 2-D [out, in], got {tuple(weight.shape)}")
    want = scale_shape(*weight.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)} does not match "
                         f"{name}'s {tuple(weight.shape)} in {block[0]}x{block[1]} blocks "
                         f"(expected {want})")
    if not scale_inv.dtype.is_floating_point or scale_inv.element_size() < 2:
        raise ValueError(f"{name}_scale_inv: scales must be float32 (or bf16), got "
                         f"{scale_inv.dtype}")


def _expand(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-block scales [ceil(n / bn), ceil(k / bk)] -> per-element [n, k] (fp32)."""
    return (scale.float().repeat_interleave(block[0], 0)[:n]
            .repeat_interleave(block[1], 1)[:, :k])


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (weight e4m3 [N, K], weight_scale_inv fp32), each block
    scaled so that its largest magnitude maps to 448."""
    n, k = w.shape
    sn, sk = scale_shape(n, k, block)
    padded = w.float().new_zeros(sn * block[0], sk * block[1])
    padded[:n, :k] = w.float()
    blocks = padded.view(sn, block[0], sk, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=_MIN_SCALE)  # [sn, sk]
    q = (w.float() / _expand(scale, n, k, block)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized [N, K] weight in `dtype` (fp32 products, then one rounding)."""
    check_weight("weight", weight, scale_inv, block)
    n, k = weight.shape
    return (weight.float() * _expand(scale_inv, n, k, block)).to(dtype)


def quantize_activations(x: torch.Tensor, group: int = BLOCK[1]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-group quantization: x [T, K] -> (e4m3 [T, K], scales fp32
    [T, ceil(K / group)])."""
    t, k = x.shape
    g = math.ceil(k / group)
    padded = x.float().new_zeros(t, g * group)
    padded[:, :k] = x.float()
    scale = (padded.view(t, g, group).abs().amax(dim=-1) / E4M3_MAX).clamp(min=_MIN_SCALE)
    full = scale.repeat_interleave(group, 1)[:, :k]
    return (x.float() / full).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def w8a8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    block: tuple[int, int] = BLOCK, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """x [T, K] through an FP8 block-scaled weight [N, K] -> [T, N] in x's dtype: x quantized
    per token and K block at run time, the e4m3 products summed in fp32 with both scales."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {weight.shape[1]}")
    x_q, x_scale = quantize_activations(x.reshape(-1, x.shape[-1]), block[1])
    x_deq = x_q.float() * x_scale.repeat_interleave(block[1], 1)[:, :x.shape[-1]]
    out = x_deq @ dequantize_blockwise(weight, scale_inv, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
