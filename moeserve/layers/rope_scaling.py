"""RoPE frequencies of the default and YaRN inits, and YaRN's softmax-scale correction, as
transformers 5.17 computes them (modeling_rope_utils: `_compute_default_rope_parameters`,
`_compute_yarn_parameters`; DeepSeek's `yarn_get_mscale`).

    default: inv_freq[i] = 1 / theta ** (2i / dim),            cos/sin factor 1
    yarn:    inv_freq = interpolation (inv_freq / factor) blended with extrapolation
             (inv_freq) by a linear ramp between the correction dims of beta_fast / beta_slow;
             cos/sin factor = attention_factor, else mscale(factor, mscale) /
             mscale(factor, mscale_all_dim) (both set), else mscale(factor)
    softmax scale (DeepSeek MLA): head_dim ** -0.5 x mscale(factor, mscale_all_dim) ** 2 when
             mscale_all_dim is set
    mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1
"""

from __future__ import annotations

import math

import torch

from moeserve.model_config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_factor(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """The [dim / 2] fp32 inverse frequencies over `dim` rotary dims and the factor the cos and
    sin tables are multiplied by."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** exponents), 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    pos_freqs = rope.theta ** exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention)


def softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """The attention softmax scale: head_dim ** -0.5, with DeepSeek's YaRN correction."""
    scale = head_dim ** -0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale
