"""quant/int4_pack.py against compressed-tensors itself (the format's producer: its
PackedQuantizationCompressor compresses and decompresses a linear's state dict) and an
independent decoder written from the layout's definition (element i in bits 4 (i % 8) of word
i // 8, stored as q + 8), so that a wrong nibble order, a sign error in the offset or a
misindexed group scale cannot pass both ways. K = 320 gives 40 words and 10 groups of 32 a row;
77 columns a partial last word (our packer against theirs).
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from moeserve.quant.int4_pack import (
    check_weight,
    dequantize,
    pack,
    quantize,
    unpack,
    w4a16_linear_ref,
)
from tests.quant.test_fp8_block import _weight

GROUP = 32


def decode(packed: torch.Tensor, k: int) -> list[list[int]]:
    rows = []
    for words in packed.tolist():
        row = []
        for i in range(k):
            word = words[i // 8] & 0xFFFFFFFF  # as unsigned bits
            row.append(((word >> (4 * (i % 8))) & 0xF) - 8)
        rows.append(row)
    return rows


def _scheme() -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))


@pytest.mark.parametrize(("n", "k"), [(6, 320), (5, 96)])  # the producer wants whole groups
def test_the_producer_s_bytes_decode_independently_and_here(n: int, k: int) -> None:
    w = _weight(n, k, seed=k)
    _, scale = quantize(w, GROUP)
    scale = scale.to(torch.bfloat16)
    made = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale},
                                                 _scheme())
    packed, shape = made["weight_packed"], made["weight_shape"]
    assert packed.dtype == torch.int32 and shape.tolist() == [n, k]
    assert unpack(packed, k).tolist() == decode(packed, k)
    ours = dequantize(packed, made["weight_scale"], shape, GROUP)
    theirs = PackedQuantizationCompressor.decompress(dict(made), _scheme())["weight"]
    assert theirs.dtype == torch.bfloat16  # their product rounded to the scale's dtype
    assert torch.equal(dequantize(packed, made["weight_scale"], shape, GROUP,
                                  torch.bfloat16), theirs)
    # symmetric rounding: within half a step of each group's scale
    step = scale.float().repeat_interleave(GROUP, 1)[:, :k]
    assert ((ours - w).abs() <= step / 2 + step * 1e-2).all()


def test_our_packing_is_the_producer_s() -> None:
    q = torch.randint(-8, 8, (4, 77), generator=torch.Generator().manual_seed(0),
                      dtype=torch.int8)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    assert torch.equal(pack(q), pack_to_int32(q, 4))
    assert torch.equal(unpack(pack(q), 77), q)
    with pytest.raises(ValueError, match="must lie in -8..7"):
        pack(torch.full((1, 8), 8, dtype=torch.int8))


def test_bad_tensors_are_named() -> None:
    packed, scale = quantize(_weight(4, 64), GROUP)
    shape = torch.tensor([4, 64])
    assert check_weight("layers.0.mlp.experts.1.up_proj.weight", packed, scale, shape,
                        GROUP) == (4, 64)
    with pytest.raises(ValueError, match=r"up_proj.weight_packed: must be int32 \[4, 8\]"):
        check_weight("up_proj.weight", packed[:, :4], scale, shape, GROUP)
    with pytest.raises(ValueError, match=r"up_proj.weight_scale: must be floating \[4, 2\]"):
        check_weight("up_proj.weight", packed, scale.t(), shape, GROUP)
    with pytest.raises(ValueError, match="up_proj.weight_shape: must hold"):
        check_weight("up_proj.weight", packed, scale, torch.tensor([4]), GROUP)


def test_weight_only_linear_uses_the_dequantized_weight() -> None:
    x = _weight(3, 320, seed=9).to(torch.bfloat16)
    packed, scale = quantize(_weight(24, 320, seed=10), GROUP)
    shape = torch.tensor([24, 320])
    out = w4a16_linear_ref(x, packed, scale, shape, GROUP)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 24)
    expected = x.float() @ dequantize(packed, scale, shape, GROUP).t()
    assert torch.allclose(out.float(), expected, rtol=1e-2, atol=1e-3)
