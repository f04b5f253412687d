"""A small interpreter of the PTX the 4-bit decodes inline (nvfp4_tile's and int4_tile's asm):
mov, prmt, and, or, lop3, shl, shr on b32, and mul / fma on bf16x2 with round-to-nearest-even, so
that a wrong selector, mask, constant or output order fails on the CPU, not only on the GPU."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import torch

MASK = 0xFFFFFFFF


def bf16(bits: int) -> float:
    """The value of bf16 bits (16-bit int)."""
    return torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(
        torch.float32).item()


def bf16_bits(value: float) -> int:
    """bf16 bits of `value` rounded once to nearest even (normals, subnormals, signed zero;
    no overflow): computed from the exact double, not through fp32 (no double rounding)."""
    sign = 0x8000 if math.copysign(1.0, value) < 0 else 0
    x = abs(value)
    if x == 0:
        return sign
    _, e = math.frexp(x)  # x = m 2^e, 0.5 <= m < 1
    exponent = e - 1 + 127
    if exponent <= 0:  # subnormal: units of 2^-133
        q = round(x / 2.0 ** -133)
        return sign | q  # 128 carries into the smallest normal
    q = round(x / 2.0 ** (e - 8))  # 8 significant bits, in [128, 256]
    if q == 256:
        exponent, q = exponent + 1, 128
    return sign | exponent << 7 | (q - 128)


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def _halves(x: int) -> tuple[float, float]:
    return bf16(x & 0xFFFF), bf16(x >> 16 & 0xFFFF)


def _pack(lo: float, hi: float) -> int:
    return bf16_bits(lo) | bf16_bits(hi) << 16


def _exact_fma(a: float, b: float, c: float) -> float:
    """a * b + c in a double, refused where the double rounds (then bf16 would round twice)."""
    value = a * b + c
    if Fraction(a) * Fraction(b) + Fraction(c) != Fraction(value):
        raise AssertionError(f"the emulator's fma of {a}, {b}, {c} is not exact in a double")
    return value


def emulate(body: str, regs: dict[str, int]) -> dict[str, int]:
    """Run the PTX block `body` (a str or Triton constexpr) on the registers `regs` ("$4":
    value, ...); returns every register after it."""
    reg = dict(regs)

    def val(x: str) -> int:
        return reg[x] if x in reg else int(x, 0)

    body = getattr(body, "value", body)
    for op, operands in re.findall(r"([a-z0-9.]+)\s+([^;]+);", body):
        if op == ".reg":
            continue
        d, *src = [a.strip() for a in operands.split(",")]
        v = [val(s) for s in src]
        if op == "mov.b32":
            reg[d] = v[0]
        elif op == "prmt.b32":
            reg[d] = prmt(*v)
        elif op == "and.b32":
            reg[d] = v[0] & v[1]
        elif op == "or.b32":
            reg[d] = v[0] | v[1]
        elif op == "lop3.b32":  # bit i of the result: the table's bit (a_i << 2 | b_i << 1 | c_i)
            a, b, c, lut = v
            reg[d] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1)
                         << i for i in range(32))
        elif op == "shl.b32":
            reg[d] = (v[0] << v[1]) & MASK
        elif op == "shr.b32":
            reg[d] = v[0] >> v[1]
        elif op == "mul.rn.bf16x2":
            (a0, a1), (b0, b1) = _halves(v[0]), _halves(v[1])
            reg[d] = _pack(a0 * b0, a1 * b1)  # bf16 x bf16 is exact in a double
        elif op == "fma.rn.bf16x2":
            (a0, a1), (b0, b1), (c0, c1) = _halves(v[0]), _halves(v[1]), _halves(v[2])
            reg[d] = _pack(_exact_fma(a0, b0, c0), _exact_fma(a1, b1, c1))
        else:
            raise AssertionError(f"the emulator lacks {op}")
    return reg
