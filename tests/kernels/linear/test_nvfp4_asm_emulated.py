"""nvfp4_tile's inline-PTX decode, run on the CPU: ptx_emulator.py's interpreter executes
`_E2M1_BF16X2_ASM` itself, so a wrong selector, mask or output order fails here, not only on
the GPU (whose tests compare its bits with the "bits" decode). Every byte and e4m3 scale
code; the scale shift and `unscale`'s factor agree with the kernel's literal."""

from __future__ import annotations

import inspect

import torch

from moeserve.kernels.linear import nvfp4_tile
from moeserve.quant.fp8_block import E4M3
from moeserve.quant.nvfp4 import E2M1_VALUES
from tests.kernels.linear.ptx_emulator import bf16 as _bf16
from tests.kernels.linear.ptx_emulator import bf16_bits as _bf16_bits
from tests.kernels.linear.ptx_emulator import emulate


def run_asm(word: int, s01: int, s23: int) -> list[int]:
    """The PTX of nvfp4_tile's asm decode on one packed word and its two bf16x2 scale words:
    the four output registers $0..$3."""
    reg = emulate(nvfp4_tile._E2M1_BF16X2_ASM, {"$4": word, "$5": s01, "$6": s23})
    return [reg[f"${i}"] for i in range(4)]


def test_the_asm_decode_gives_every_weight_times_its_scale_times_2_to_minus_10() -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    scales = codes.view(E4M3).float()  # every finite e4m3 value, subnormals and signs too
    shift = 2.0 ** nvfp4_tile.ASM_SCALE_SHIFT
    for trial in range(64):
        b = torch.randint(0, 256, (4,), generator=gen).tolist()
        if trial < 16:  # every nibble code in both halves of byte 0 at least once
            b[0] = trial * 17
        s = scales[torch.randint(0, len(scales), (4,), generator=gen)].tolist()
        sb = [_bf16_bits(x * shift) for x in s]  # the kernel's (scale x 2^116) in bf16
        out = run_asm(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24, sb[0] | sb[1] << 16,
                      sb[2] | sb[3] << 16)
        halves = [_bf16((r >> sh) & 0xFFFF) for r in out for sh in (0, 16)]
        want_lo = [E2M1_VALUES[x & 0xF] * s[i] for i, x in enumerate(b)]
        want_hi = [E2M1_VALUES[x >> 4] * s[i] for i, x in enumerate(b)]
        unscale = 2.0 ** (126 - nvfp4_tile.ASM_SCALE_SHIFT)
        got = [h * unscale for h in halves]
        assert got == want_lo + want_hi, (b, s)
        # the sign of zero too (-0 nibbles give -0, as the "bits" decode)
        for g, w in zip(got, want_lo + want_hi):
            assert (str(g)[0] == "-") == (str(w)[0] == "-")


def test_the_kernels_constants_agree_with_the_shift() -> None:
    source = inspect.getsource(nvfp4_tile)
    assert repr(2.0 ** nvfp4_tile.ASM_SCALE_SHIFT).replace("+", "") in source
    assert float(2 ** (126 - nvfp4_tile.ASM_SCALE_SHIFT)) == 1024.0
    assert "return 1024.0" in inspect.getsource(nvfp4_tile.unscale.fn if hasattr(
        nvfp4_tile.unscale, "fn") else nvfp4_tile.unscale)
