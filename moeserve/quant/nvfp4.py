"""NVFP4 weights (NVIDIA ModelOpt; the seeds' GLM-5-NVFP4): torch references for the format and
its weight-only arithmetic (Hopper has no FP4 tensor cores: W4A16, as vLLM and SGLang run it
there with Marlin).

Per linear layer of out_features N and in_features K (K a multiple of 16):

    weight          uint8 [N, K / 2]: two e2m1 values a byte, element 2j in the LOW nibble
    weight_scale    float8_e4m3fn [N, K / 16]: one scale per 16 consecutive elements of a row
    weight_scale_2  float32 scalar: the global scale (amax / (6 x 448) at quantization)
    input_scale     float32 scalar: the activations' scale for FP4 activations (Blackwell's
                    W4A4); weight-only serving leaves it unused
    dequantized     W[n, k] = e2m1(weight nibble) * weight_scale[n, k // 16] * weight_scale_2

e2m1 (a nibble): bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa; exponent 0
is subnormal (0.5 x mantissa). Magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

from moeserve.quant.fp8_block import E4M3, E4M3_MAX

GROUP = 16
E2M1_MAX = 6.0
# the 16 nibble values, by their bits (sign in bit 3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MIN_SCALE = 1e-12


def check_weight(name: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor) -> None:
    """A checkpoint's NVFP4 weight and its scales, or a ValueError naming the tensor."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"{name}: NVFP4 weight must be 2-D uint8 [out, in / 2] (two e2m1 "
                         f"values a byte), got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if k % GROUP:
        raise ValueError(f"{name}: in_features {k} is not a multiple of the group of {GROUP}")
    if weight_scale.dtype != E4M3:
        raise ValueError(f"{name}_scale: NVFP4 group scales must be float8_e4m3fn, got "
                         f"{weight_scale.dtype}")
    if tuple(weight_scale.shape) != (n, k // GROUP):
        raise ValueError(f"{name}_scale: shape {tuple(weight_scale.shape)} does not match "
                         f"{name}'s [{n}, {k}] in groups of {GROUP} (expected "
                         f"{(n, k // GROUP)})")
    if weight_scale_2.numel() != 1 or weight_scale_2.dtype != torch.float32:
        raise ValueError(f"{name}_scale_2: the global scale must be one float32 value, got "
                         f"{weight_scale_2.dtype} {tuple(weight_scale_2.shape)}")


def unpack_e2m1(weight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> the e2m1 values [N, K] fp32 (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    low, high = (weight & 0xF).long(), (weight >> 4).long()
    return torch.stack([table[low], table[high]], dim=-1).flatten(-2)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (already in e2m1's range) -> the nibble codes [..] uint8 of the nearest e2m1 value
    (a tie goes to the smaller magnitude)."""
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    code = (mag[..., None] - grid).abs().argmin(dim=-1)  # first of equals: the smaller one
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight uint8 [N, K / 2], weight_scale e4m3 [N, K / 16], weight_scale_2
    fp32 []), as ModelOpt lays them out: the global scale maps the largest group scale to
    e4m3's 448, each group's largest magnitude to e2m1's 6."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"in_features {k} is not a multiple of the group of {GROUP}")
    w = w.float()
    scale_2 = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=_MIN_SCALE)
    groups = w.view(n, k // GROUP, GROUP)
    group_scale = (groups.abs().amax(dim=-1) / E2M1_MAX / scale_2).clamp(max=E4M3_MAX)
    scale = group_scale.to(E4M3)  # [N, K / 16]
    step = (scale.float() * scale_2).clamp(min=_MIN_SCALE)[..., None]
    codes = _round_e2m1(groups / step).view(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale, scale_2.reshape(())


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized [N, K] weight in `dtype`."""
    check_weight("weight", weight, weight_scale, weight_scale_2)
    values = unpack_e2m1(weight)  # [N, K]
    scales = weight_scale.float().repeat_interleave(GROUP, dim=1) * weight_scale_2.float()
    return (values * scales).to(dtype)


def w4a16_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x [..., K] through an NVFP4 weight [N, K] (weight-only: x stays in its dtype) ->
    [..., N] in x's dtype, the product in fp32."""
    w = dequantize(weight, weight_scale, weight_scale_2)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.shape[1]}")
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
