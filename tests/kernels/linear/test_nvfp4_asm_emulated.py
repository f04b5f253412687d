"""nvfp4_tile's inline-PTX decode, run on the CPU: a small interpreter of the instructions it
uses (mov, prmt, and, or, shl, shr, mul.rn.bf16x2) executes `_E2M1_BF16X2_ASM` itself, so a
wrong selector, mask or output order fails here, not only on the GPU (whose tests compare its
bits with the "bits" decode). Every byte and e4m3 scale code; the scale shift and `unscale`'s
factor agree with the kernel's literal."""

from __future__ import annotations

import inspect
import re

import torch

from moeserve.kernels.linear import nvfp4_tile
from moeserve.quant.fp8_block import E4M3
from moeserve.quant.nvfp4 import E2M1_VALUES

MASK = 0xFFFFFFFF


def _bf16(bits: int) -> float:
    return torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(
        torch.float32).item()


def _bf16_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float32).to(torch.bfloat16).view(
        torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def _mul_bf16x2(a: int, b: int) -> int:
    halves = [_bf16_bits(_bf16((a >> s) & 0xFFFF) * _bf16((b >> s) & 0xFFFF)) for s in (0, 16)]
    return halves[0] | halves[1] << 16


def run_asm(word: int, s01: int, s23: int) -> list[int]:
    """The PTX of nvfp4_tile's asm decode on one packed word and its two bf16x2 scale words:
    the four output registers $0..$3."""
    reg = {"$4": word, "$5": s01, "$6": s23}

    def val(x: str) -> int:
        return reg[x] if x in reg else int(x, 0)

    body = nvfp4_tile._E2M1_BF16X2_ASM
    body = getattr(body, "value", body)
    for ins in re.findall(r"([a-z0-9.]+)\s+([^;]+);", body):
        op, args = ins[0], [a.strip() for a in ins[1].split(",")]
        if op == ".reg":
            continue
        d, *src = args
        if op == "mov.b32":
            reg[d] = val(src[0])
        elif op == "prmt.b32":
            reg[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "and.b32":
            reg[d] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            reg[d] = val(src[0]) | val(src[1])
        elif op == "shl.b32":
            reg[d] = (val(src[0]) << val(src[1])) & MASK
        elif op == "shr.b32":
            reg[d] = val(src[0]) >> val(src[1])
        elif op == "mul.rn.bf16x2":
            reg[d] = _mul_bf16x2(val(src[0]), val(src[1]))
        else:
            raise AssertionError(f"the emulator lacks {op}")
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
