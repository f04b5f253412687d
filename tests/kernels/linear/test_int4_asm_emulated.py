"""int4_tile's inline-PTX decode ("planes-asm"), run on the CPU by ptx_emulator.py: every
nibble of two packed words in each of the eight planes, against (nibble - 8) x scale rounded
once to bf16 (the "planes" and "reshape" decodes' bits), for bf16 scales of every sign and
size the checkpoints use; and the decode's choice by BLOCK_K, dtypes and device."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.linear import int4_tile
from tests.kernels.linear.ptx_emulator import bf16, bf16_bits, emulate


def _want(nibble: int, scale_bits: int) -> int:
    """(nibble - 8) x scale in fp32 (exact: 4 x 8 significant bits), rounded once to bf16."""
    product = torch.tensor([(nibble - 8) * bf16(scale_bits)], dtype=torch.float32)
    return int(product.to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def test_every_plane_of_two_words_is_the_nibble_less_8_times_its_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(96):
        words = torch.randint(0, 2**32, (2,), generator=gen, dtype=torch.int64).tolist()
        if trial < 16:  # every nibble code in every plane of word 0 at least once
            words[0] = sum(((trial + i) % 16) << 4 * i for i in range(8))
        exponent = int(torch.randint(-20, 8, (), generator=gen))
        scales = [bf16_bits(float(torch.rand((), generator=gen)) * 2.0 ** exponent * sign)
                  for sign in (1, -1 if trial % 3 == 0 else 1)]
        reg = emulate(int4_tile._INT4_BF16X2_ASM,
                      {"$8": words[0], "$9": words[1], "$10": scales[0] | scales[1] << 16})
        for plane in range(8):
            out = reg[f"${plane}"]
            for half, (word, scale) in enumerate(zip(words, scales)):
                got = out >> 16 * half & 0xFFFF
                nibble = word >> 4 * plane & 0xF
                assert got == _want(nibble, scale), (trial, plane, half, hex(word))


def test_the_decode_by_block_k_dtypes_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    bf, f32 = torch.bfloat16, torch.float32
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    reshape, planes, asm = (int4_tile.DECODES.index(d) for d in int4_tile.DECODES)
    assert int4_tile.decode == "auto"
    assert int4_tile.decode_id(128, bf, bf, cuda) == asm
    assert int4_tile.decode_id(256, bf, bf, cuda) == asm
    assert int4_tile.decode_id(64, bf, bf, cuda) == reshape  # a plane's dot needs K >= 16
    assert int4_tile.decode_id(128, bf, f32, cuda) == planes  # fp32 scales: fp32 products
    assert int4_tile.decode_id(128, f32, f32, cpu) == planes
    assert int4_tile.decode_id(128, bf, bf, cpu) == planes
    monkeypatch.setattr(int4_tile, "decode", "planes-asm")
    with pytest.raises(ValueError, match="needs bf16 activations and scales on CUDA"):
        int4_tile.decode_id(128, bf, torch.float16, cuda)
    with pytest.raises(ValueError, match="needs BLOCK_K a multiple of 128"):
        int4_tile.decode_id(64, bf, bf, cuda)
