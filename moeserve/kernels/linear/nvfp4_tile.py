"""One K step of an NVFP4 weight tile on Triton, shared by the W4A16 linear (w4a16_triton.py)
and the quantized fused MoE (moe/quant/fused_triton.py): the packed bytes dequantized in
registers and dotted with the activations, with no reshape of the weight tile.

    nvfp4_step(acc, a, byte, scale)
        a     [BM, BK]      the activations of the step's K columns (x's dtype)
        byte  [BK / 2, BN]  the packed bytes (uint8): byte j holds k = 2j (low nibble) and
                            2j + 1 (high nibble)
        scale [BK / 16, BN] fp32, the group scales (e4m3's values), each spread over its
                            group's 8 bytes in registers
        -> acc + a[:, 0::2] @ W_lo + a[:, 1::2] @ W_hi   with W_h[j, n] = e2m1(nibble h) *
                                                          scale[j // 8, n]

The step splits a into its even and odd columns (a reshape to [BM, BK / 2, 2] and tl.split:
the small operand moves, the weight tile stays as loaded) and dots each with the tile of one
nibble, so BK / 2 must be at least 16 (tl.dot's K): BLOCK_K >= 32. The global scale is not
applied here: the caller multiplies its fp32 accumulator by it per output column, and by
`unscale(DECODE)`.

The nibble's value comes from its bits: sign-magnitude s m2 m1 m0 set as fp16 bits s << 15 |
m << 9 is exactly the e2m1 value times 2^-14 (exponent 0 is fp16's subnormal, as e2m1's is),
converted to fp32 exactly and multiplied by scale * 2^14; e2m1 x e4m3 has at most 7
significant bits in [2^-10, 2688], so that product and its cast to x's dtype (fp32, fp16 or
bf16) round nothing: the tile equals packed.dequantize(...) / global_scale bit for bit. About
8 integer and float operations an element, against the ~20 and two layout conversions of
decoding [BK, BN] nibbles after a reshape (measured at 7e90c0c: benchmarks/results/gpu_7e90c0c).

`e4m3_bits_to_f32` decodes e4m3 bytes by bit arithmetic: Triton's interpreter loads
float8_e4m3fn's NaN codes as +-480, so on CPU the callers load the scales' bytes and decode
them here (on CUDA the float8 load and its hardware conversion). The functions are plain
Python until `jitted()` wraps them (the callers' kernels jit on first use, see fused_triton.py).

`decode` "asm" does the nibbles' decode and the scale's multiply in inline PTX on bf16 pairs,
about 2.5 instructions a weight against the "bits" path's 8 or so. Its tile is the weight times
2^-10 (the scales enter times 2^116, so that bf16's exponent bias needs no multiply of its own),
and `unscale` gives the epilogue the 2^10 back: a power of two throughout, so both decodes give
the same bits (the GPU tests compare them; tests/kernels/linear/test_nvfp4_asm_emulated.py runs the
PTX itself through an emulator on the CPU), and the choice is speed alone. "auto" (the
default) takes "asm" where it runs (bf16 activations on CUDA: the 4-instruction asm was 15-17%
faster than "bits" on the H200 at 64-8,192 tokens, benchmarks/results/gpu_1206642) and "bits"
elsewhere.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

tl: Any = None  # triton.language, bound by jitted(): the helpers read it as a global
MIN_BLOCK_K = 32  # each nibble's dot has K = BLOCK_K / 2 >= 16
DECODES = ("bits", "asm")  # the DECODE constexpr's values, in order
# The decode the kernels compile: "auto", or one of DECODES (benchmarks and tests set it;
# benchmarks/quant/kernels_quant.py --nvfp4-decode times each).
decode = "auto"

# "asm": four packed bytes ($4) and their four bf16 group scales ($5: bytes 0-1, $6: 2-3) ->
# the low nibbles' four bf16 weights ($0, $1) and the high nibbles' ($2, $3). prmt puts byte 0
# (2) in the high byte of one half of a register and byte 1 (3) in the other's, so that a high
# nibble s m2 m1 m0 sits at bits 12-15 of its half and a low one at bits 8-11; bf16 bits
# s << 15 | m << 6 are the nibble's e2m1 value times 2^-126 (m 1: bf16's subnormal, as e2m1's
# is): for a high nibble (p >> 6) & 0x01C0 | (p & 0x8000), for a low one (p >> 2 | p << 4) &
# 0x81C0 (where each shifted copy is zero at the other's bits: one lop3). The scales come times
# 2^116 (ASM_SCALE_SHIFT), so the product is the weight times 2^-10, normal and exact (at most
# 7 significant bits); `unscale` gives the epilogue its 2^10 back. 18 instructions for 8
# weights (the 16 x 64 gated MoE tile's sm90 loop 502 instructions a 128-K step, 534 with the
# masks and shifts of each nibble apart; the decode with 2^126 folded in by a multiply of its
# own took 4 a weight).
_E2M1_BF16X2_ASM = """{
.reg .b32 z, p0, p1, a, b, m;
mov.b32 z, 0;
prmt.b32 p0, $4, z, 0x1404;
prmt.b32 p1, $4, z, 0x3424;
shr.b32 a, p0, 6; and.b32 b, p0, 0x80008000; lop3.b32 m, a, b, 0x01C001C0, 0xEC;
mul.rn.bf16x2 $2, m, $5;
shr.b32 a, p1, 6; and.b32 b, p1, 0x80008000; lop3.b32 m, a, b, 0x01C001C0, 0xEC;
mul.rn.bf16x2 $3, m, $6;
shr.b32 a, p0, 2; shl.b32 b, p0, 4; lop3.b32 m, a, b, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $0, m, $5;
shr.b32 a, p1, 2; shl.b32 b, p1, 4; lop3.b32 m, a, b, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $1, m, $6;
}"""
ASM_SCALE_SHIFT = 116  # the asm decode's scales x 2^116: its tile is the weight x 2^-10


def decode_id(x_dtype, device) -> int:
    """The DECODE constexpr of `decode` for activations of x_dtype on device: "auto" is "asm"
    where it runs, else "bits"; ValueError where "asm", asked for, cannot run (it needs bf16
    activations on CUDA)."""
    if decode not in ("auto", *DECODES):
        raise ValueError(f"nvfp4_tile.decode must be one of {('auto', *DECODES)}, "
                         f"got {decode!r}")
    asm_runs = device.type == "cuda" and x_dtype == torch.bfloat16
    if decode == "auto":
        return DECODES.index("asm" if asm_runs else "bits")
    if decode == "asm" and not asm_runs:
        raise ValueError(f"nvfp4 decode 'asm' needs bf16 activations on CUDA, got {x_dtype} "
                         f"on {device.type}")
    return DECODES.index(decode)


def nvfp4_step(acc, a, byte, scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ the dequantized [BK, BN] tile (module docstring), scale the
    step's [BK / 16, BN] group scales (fp32, each spread over its 8 bytes here); DECODE 0
    "bits" (Triton's integer and fp32 ops), 1 "asm" (PTX on bf16 pairs; bf16 a, CUDA), whose
    sums carry 2^-10: the caller's epilogue multiplies by `unscale(DECODE)`."""
    a_lo, a_hi = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))  # k = 2j, 2j + 1
    w_lo, w_hi = decoded_tiles(byte, scale, DECODE, a.dtype)
    acc = tl.dot(a_lo, w_lo, acc, input_precision=DOT_PRECISION)
    return tl.dot(a_hi, w_hi, acc, input_precision=DOT_PRECISION)


def decoded_tiles(byte, scale, DECODE: tl.constexpr, dtype):
    """The packed bytes' [BK / 2, BN] low and high nibbles dequantized (in dtype): each times
    its group's scale (scale [BK / 16, BN] fp32), by the "asm" decode (DECODE 1: the scales x
    2^116 in bf16 first, one a byte; the tiles carry 2^-10) or "bits" (0)."""
    if DECODE == 1:  # the scales x 2^116 (exact: e4m3 <= 448), in bf16, one a byte
        step = spread_groups((scale * 8.307674973655724e34).to(tl.bfloat16), 8)
        return tl.inline_asm_elementwise(
            _E2M1_BF16X2_ASM, "=r,=r,=r,=r,r,r,r", [byte, step],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    step = spread_groups(scale, 8) * 16384.0  # a scale a byte; nibbles decode to value x 2^-14
    lo, hi = nibble_values(byte.to(tl.int32))
    return (lo * step).to(dtype), (hi * step).to(dtype)


def nibble_values(bits):
    """Packed bytes (int32) -> the e2m1 values of their low and high nibbles x 2^-14, fp32,
    exactly: sign-magnitude s m2 m1 m0 set as fp16 bits s << 15 | m << 9 (the module doc)."""
    lo = (((bits & 7) << 9) | ((bits & 8) << 12)).to(tl.int16)
    hi = (((bits & 0x70) << 5) | ((bits & 0x80) << 8)).to(tl.int16)
    return (lo.to(tl.float16, bitcast=True).to(tl.float32),
            hi.to(tl.float16, bitcast=True).to(tl.float32))


def unscale(DECODE: tl.constexpr):
    """What the caller multiplies `nvfp4_step`'s sums by: 2^10 after the "asm" decode (its tile
    is the weight x 2^-10), 1 after "bits". A power of two: the product's bits are the same."""
    if DECODE == 1:
        return 1024.0
    return 1.0


def spread_groups(s, ROWS: tl.constexpr):
    """[G, BN] group scales -> [G x ROWS, BN]: each over its group's ROWS rows (bytes or
    nibbles) of the weight tile, in registers; the 4-bit kernels load each scale once."""
    groups: tl.constexpr = s.shape[0]
    cols: tl.constexpr = s.shape[1]
    return tl.reshape(tl.broadcast_to(s[:, None, :], (groups, ROWS, cols)), (groups * ROWS, cols))


def e4m3_bits_to_f32(bits):
    """float8_e4m3fn bytes (int32, 0..255) -> fp32: bit 7 sign, bits 6-3 exponent (bias 7),
    bits 2-0 mantissa; exponent 0 is subnormal (mantissa x 2^-9); 0x7F / 0xFF NaN."""
    exp = (bits >> 3) & 15
    man = bits & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
    value = tl.where(bits >= 128, -value, value)
    return tl.where((bits & 127) == 127, float("nan"), value)


@functools.cache
def jitted() -> SimpleNamespace:
    """The helpers as Triton functions (bound here as module globals too: they call each other
    by name); triton is imported here, on first use."""
    global tl, nibble_values, nvfp4_step, e4m3_bits_to_f32, spread_groups, unscale
    global decoded_tiles
    global _E2M1_BF16X2_ASM
    import triton
    import triton.language

    tl = triton.language
    if isinstance(_E2M1_BF16X2_ASM, str):  # a kernel reads only constexpr globals
        _E2M1_BF16X2_ASM = tl.constexpr(_E2M1_BF16X2_ASM)
    nibble_values, nvfp4_step, e4m3_bits_to_f32, spread_groups, unscale = (
        triton.jit(f) for f in (nibble_values, nvfp4_step, e4m3_bits_to_f32, spread_groups,
                                unscale))
    decoded_tiles = triton.jit(decoded_tiles)
    return SimpleNamespace(nvfp4_step=nvfp4_step, e4m3_bits_to_f32=e4m3_bits_to_f32,
                           spread_groups=spread_groups, unscale=unscale,
                           nibble_values=nibble_values)
