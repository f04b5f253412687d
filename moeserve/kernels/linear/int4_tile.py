"""One K step of an INT4 weight tile on Triton by nibble planes, for the quantized fused MoE
(moe/quant/fused_triton.py): the packed words dequantized in registers and dotted with the
activations, with no reshape of the weight tile (as nvfp4_tile.py does for NVFP4's bytes).

    int4_planes_step(acc, a, packed, scale)
        a       [BM, BK]      the activations of the step's K columns (x's dtype)
        packed  [BK / 8, BN]  int32 words of 8 nibbles: word j holds k = 8j + i at bits 4i,
                              stored q + 8 (compressed-tensors' pack-quantized layout)
        scale   [BK / 8, BN]  fp32 group scales, each spread over its group's GROUP / 8 words
        -> acc + sum over i of a[:, i::8] @ W_i   with W_i[j, n] = (nibble i of word j - 8) *
                                                  scale[j, n]

The "reshape" decode (fused_triton's DECODE 0 for int4) shifts each word by every nibble's
offset into a [BK / 8, 8, BN] tile and reshapes it to [BK, BN]: Triton 3.6's sm90 SASS of the
16 x 64 x 64 gated tile then stores every decoded weight to shared memory and reads it back
for the dot (66 STS, 64 I2FP, 64 FMUL a thread a K step, 543 loop instructions). Here the
activations move instead (a's eight column classes by three tl.split, a [BM, BK] tile of
x's dtype), each nibble plane is its own dot of K = BK / 8, so BLOCK_K >= 128 (tl.dot's K
>= 16): `takes(block_k)`.

The plane's value is (nibble - 8) * scale in fp32, rounded once to x's dtype: the same bits
as packed.dequantize(...) in x's dtype, so "planes" and "reshape" give the same tile and the
choice is speed alone. The functions are plain Python until `jitted()` wraps them.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

tl: Any = None  # triton.language, bound by jitted(): the helpers read it as a global
PLANES = 8  # nibbles a word
MIN_BLOCK_K = 16 * PLANES  # each plane's dot has K = BLOCK_K / 8 >= 16
# fused_triton's DECODE constexpr for int4, in order: "planes-asm" is "planes" with the decode
# in inline PTX on bf16 pairs (bf16 activations and scales on CUDA)
DECODES = ("reshape", "planes", "planes-asm")
# The decode the kernels compile: "auto" (the fastest that runs at the tile's BLOCK_K and
# dtypes: "planes-asm", else "planes", else "reshape"), or one of DECODES (benchmarks and
# tests set it; kernels_quant --int4-decode).
decode = "auto"

# "planes-asm": two packed words ($8, $9: elements 0 and 1 of the pair) and their bf16 scales
# ($10) -> the eight planes' bf16 pairs ($0..$7: plane i of word 0 in the low half, of word 1
# in the high). prmt puts byte c of each word in its half's low byte, a shift by 4 brings the
# high nibble there; (t & 0x000F000F) | 0x43004300 (one lop3, 0xEA: a & b | c) is then bf16
# 128 + n for the nibble n (bf16 has 7 mantissa bits: a nibble at bits 4-7 would reach the
# exponent), an fma takes 136 off exactly (n - 8), and one multiply by the scale rounds once:
# (n - 8) * scale in bf16, the "planes" bits. 28 instructions for 16 weights, against ~5 a
# weight for the fp32 path; sm90 SASS of the 16 x 64 gated tile a 128-K step: 404 loop
# instructions (467 with and + or, which ptxas kept as two LOP3s; "planes" 808, "reshape"
# 1,068). bf16x2 constants: one 1.0, n136 -136.0, in both halves.
_INT4_BF16X2_ASM = """{
.reg .b32 t, u, v, one, n136;
mov.b32 one, 0x3F803F80; mov.b32 n136, 0xC308C308;
""" + "".join(f"""prmt.b32 t, $8, $9, {c | c << 4 | (4 + c) << 8 | (4 + c) << 12:#06x};
lop3.b32 v, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 v, v, one, n136; mul.rn.bf16x2 ${2 * c}, v, $10;
shr.b32 u, t, 4;
lop3.b32 v, u, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 v, v, one, n136; mul.rn.bf16x2 ${2 * c + 1}, v, $10;
""" for c in range(4)) + "}"


def takes(block_k: int) -> bool:
    """Whether a tile of this BLOCK_K can run the planes decode (a dot of K >= 16 a plane)."""
    return block_k >= MIN_BLOCK_K and block_k % MIN_BLOCK_K == 0


def decode_id(block_k: int, x_dtype: torch.dtype, scale_dtype: torch.dtype,
              device: torch.device) -> int:
    """The DECODE constexpr of `decode` at a tile's BLOCK_K for activations of x_dtype and
    scales of scale_dtype on device: "auto" the fastest that runs; ValueError where the one
    asked for cannot run ("planes" at this BLOCK_K; "planes-asm" also needs bf16 activations
    and scales on CUDA: it rounds the scale's product in bf16)."""
    if decode not in ("auto", *DECODES):
        raise ValueError(f"int4_tile.decode must be one of {('auto', *DECODES)}, got "
                         f"{decode!r}")
    asm_runs = (device.type == "cuda" and x_dtype == torch.bfloat16
                and scale_dtype == torch.bfloat16)
    if decode == "auto":
        return DECODES.index(("planes-asm" if asm_runs else "planes") if takes(block_k)
                             else "reshape")
    if decode != "reshape" and not takes(block_k):
        raise ValueError(f"int4 decode {decode!r} needs BLOCK_K a multiple of {MIN_BLOCK_K} "
                         f"(a dot of K >= 16 for each of the {PLANES} nibble planes), got "
                         f"{block_k}")
    if decode == "planes-asm" and not asm_runs:
        raise ValueError(f"int4 decode 'planes-asm' needs bf16 activations and scales on CUDA, "
                         f"got {x_dtype} and {scale_dtype} on {device.type}")
    return DECODES.index(decode)


def int4_planes_step(acc, a, packed, scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, DECODE: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ the dequantized [BK, BN] tile (module docstring): packed
    [BK / 8, BN] int32, scale [BK / 8, BN] fp32 (each word's group scale); DECODE 1 the
    planes by Triton's integer and fp32 ops, 2 by `_INT4_BF16X2_ASM` (bf16 a and scales)."""
    # a's columns 8j + 4p + 2q + r as [BM, BK / 8, p, q, r]; each split takes the last index
    a5 = tl.reshape(a, (BLOCK_M, BLOCK_K // 8, 2, 2, 2))
    a_r0, a_r1 = tl.split(a5)  # [BM, BK / 8, 2, 2]: r = 0, 1
    a_00, a_01 = tl.split(a_r0)  # [BM, BK / 8, 2]: (r, q) = (0, 0), (0, 1)
    a_10, a_11 = tl.split(a_r1)  # (1, 0), (1, 1)
    a0, a4 = tl.split(a_00)  # plane 4p + 2q + r: (r, q) = (0, 0) -> planes 0 and 4
    a2, a6 = tl.split(a_01)
    a1, a5_ = tl.split(a_10)
    a3, a7 = tl.split(a_11)
    if DECODE == 2:
        w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
            _INT4_BF16X2_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
            [packed, scale.to(tl.bfloat16)], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        w0, w1, w2, w3 = (_plane(packed, scale, 0, a.dtype), _plane(packed, scale, 1, a.dtype),
                          _plane(packed, scale, 2, a.dtype), _plane(packed, scale, 3, a.dtype))
        w4, w5, w6, w7 = (_plane(packed, scale, 4, a.dtype), _plane(packed, scale, 5, a.dtype),
                          _plane(packed, scale, 6, a.dtype), _plane(packed, scale, 7, a.dtype))
    acc = tl.dot(a0, w0, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(a1, w1, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(a2, w2, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(a3, w3, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(a4, w4, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(a5_, w5, acc, input_precision=DOT_PRECISION)
    acc = tl.dot(a6, w6, acc, input_precision=DOT_PRECISION)
    return tl.dot(a7, w7, acc, input_precision=DOT_PRECISION)


def _plane(packed, scale, i: tl.constexpr, dtype):
    """Plane i of the packed words, (nibble - 8) * scale rounded once to dtype."""
    return ((((packed >> (4 * i)) & 0xF) - 8).to(tl.float32) * scale).to(dtype)


@functools.cache
def jitted() -> SimpleNamespace:
    """The helpers as Triton functions (bound here as module globals too: they call each other
    by name); triton is imported here, on first use."""
    global tl, int4_planes_step, _plane, _INT4_BF16X2_ASM
    import triton
    import triton.language

    tl = triton.language
    if isinstance(_INT4_BF16X2_ASM, str):  # a kernel reads only constexpr globals
        _INT4_BF16X2_ASM = tl.constexpr(_INT4_BF16X2_ASM)
    int4_planes_step, _plane = (triton.jit(f) for f in (int4_planes_step, _plane))
    return SimpleNamespace(int4_planes_step=int4_planes_step)

