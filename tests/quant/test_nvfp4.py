"""quant/nvfp4.py: the NVFP4 layout, checked against an independent decoder.

The decoder reads each byte's two nibbles from the format's definition (element 2j in the low
nibble; e2m1: sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0, exponent 0 subnormal
0.5 x m) and the group scales' e4m3 bytes bit by bit (tests/quant/test_fp8_block's
`decode_e4m3`), in Python loops, so a swapped nibble order, a transposed or misindexed group
scale or a missing global scale cannot pass both ways. K = 320 gives 20 groups a row.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.quant.fp8_block import E4M3
from moeserve.quant.nvfp4 import (
    E2M1_VALUES,
    check_weight,
    dequantize,
    quantize,
    unpack_e2m1,
    w4a16_linear_ref,
)
from tests.quant.test_fp8_block import _weight, decode_e4m3


def decode_e2m1(nibble: int) -> float:
    sign = -1.0 if nibble & 0x8 else 1.0
    exp, man = (nibble >> 1) & 0x3, nibble & 0x1
    if exp == 0:
        return sign * 0.5 * man
    return sign * 2.0 ** (exp - 1) * (1 + man / 2)


def decode_weight(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor
                  ) -> torch.Tensor:
    raw, s, g = weight.tolist(), scale.view(torch.uint8).tolist(), float(scale_2)
    rows = []
    for i, row in enumerate(raw):
        values = []
        for j, byte in enumerate(row):
            for half, nibble in ((0, byte & 0xF), (1, byte >> 4)):
                k = 2 * j + half
                values.append(decode_e2m1(nibble) * decode_e4m3(s[i][k // 16]) * g)
        rows.append(values)
    return torch.tensor(rows)


def test_the_nibble_table_is_the_definition() -> None:
    assert [decode_e2m1(n) for n in range(16)] == list(E2M1_VALUES)
    assert unpack_e2m1(torch.tensor([[0x72, 0xF1]], dtype=torch.uint8)).tolist() == [
        [1.0, 6.0, 0.5, -6.0]]  # 0x72: low 2 -> 1.0, high 7 -> 6.0


@pytest.mark.parametrize(("n", "k"), [(8, 320), (33, 64), (1, 16)])
def test_quantized_weights_decode_independently(n: int, k: int) -> None:
    w = _weight(n, k, seed=n)
    packed, scale, scale_2 = quantize(w)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scale.shape == (n, k // 16) and scale.dtype == E4M3 and scale_2.numel() == 1
    ours = dequantize(packed, scale, scale_2)
    assert torch.allclose(ours, decode_weight(packed, scale, scale_2), rtol=1e-6, atol=0)
    # each value within half an e2m1 step of its group's grid (steps up to 2 at 4..6), plus the
    # e4m3 rounding of the group scale (2^-4 relative)
    step = scale.float().repeat_interleave(16, 1) * scale_2
    assert ((ours - w).abs() <= step * 1.0 + w.abs() / 16 + 1e-12).all()
    assert (ours - w).norm() / w.norm() < 0.12


def test_a_swapped_nibble_order_or_a_transposed_scale_is_caught() -> None:
    w = _weight(16, 256, seed=7)
    packed, scale, scale_2 = quantize(w)  # scale [16, 16]: a transposed one has its shape
    swapped = (packed >> 4) | (packed << 4)
    assert not torch.allclose(dequantize(swapped, scale, scale_2), w, rtol=0.2)
    assert not torch.allclose(dequantize(packed, scale.t().contiguous(), scale_2), w, rtol=0.2)
    packed, scale, scale_2 = quantize(w[:8])  # [8, 16]: transposed, the shape tells
    with pytest.raises(ValueError, match=r"experts.w13_scale: shape \(16, 8\) does not match "
                                         r"experts.w13's \[8, 256\] in groups of 16"):
        check_weight("experts.w13", packed, scale.t().contiguous(), scale_2)


def test_bad_tensors_are_named() -> None:
    packed, scale, scale_2 = quantize(_weight(4, 64))
    with pytest.raises(ValueError, match="q_proj: NVFP4 weight must be 2-D uint8"):
        check_weight("q_proj", packed.to(torch.int8), scale, scale_2)
    with pytest.raises(ValueError, match="q_proj_scale: NVFP4 group scales must be "
                                         "float8_e4m3fn"):
        check_weight("q_proj", packed, scale.float(), scale_2)
    with pytest.raises(ValueError, match="q_proj_scale_2: the global scale must be one float32"):
        check_weight("q_proj", packed, scale, scale_2.to(torch.bfloat16))
    with pytest.raises(ValueError, match="not a multiple of the group of 16"):
        quantize(torch.ones(2, 24))


def test_weight_only_linear_uses_the_dequantized_weight() -> None:
    x = _weight(3, 320, seed=11).to(torch.bfloat16)
    packed, scale, scale_2 = quantize(_weight(40, 320, seed=12))
    out = w4a16_linear_ref(x, packed, scale, scale_2)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 40)
    expected = x.float() @ decode_weight(packed, scale, scale_2).t()
    assert torch.allclose(out.float(), expected, rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="input has 64 features, the weight 320"):
        w4a16_linear_ref(x[:, :64], packed, scale, scale_2)
