"""The 4-bit experts' packed weights in micro-tiles, the layout the engine holds NVFP4 / INT4
routed experts in on CUDA (EngineConfig.moe_weight_layout; `tile_experts` at start-up), which the
quantized fused MoE's loads read.

In the row layout ([E, N, C] packed columns: C = K / 2 bytes for nvfp4, K / 8 int32 words for
int4) a 128-K step of a program reads 64 bytes of each of its weight rows, half a 128-byte line,
every row K / 2 bytes from the next. NVFP4 and INT4 reach the same ~60% of an H100's DRAM peak
at different instruction counts (benchmarks/results/gpu_2d81e17/), and 256-K steps (whole
lines) were 5-11% faster at GLM-5's shape (gpu_b547afb/). Micro-tiles make each step's reads
whole contiguous kilobytes at the 128-K step's registers:

    micro[e] = q[e].reshape(N / 16, 16, C / MC, MC).permute(0, 2, 1, 3)

16 rows x 64 bytes (MC columns of the packed dtype) contiguous, the tiles of 16 rows in K order,
the same [E, N, C] shape and bytes. `micro_offsets` is the kernel's address of (row, column).
Needs N % 16 == 0 and C % MC == 0 (K a multiple of 128); the references read the row layout
only (`from_micro` gives it back); the dequantize-first path's kernel reads micro-tiles too.

Measured (an H100, benchmarks/results/gpu_4da0855/): GLM-5's experts at 64 tokens 1.843 ms
(NVFP4) / 1.806 (INT4) micro-tiled at a 128-K step against the best row-layout tile's 2.120 /
1.977 (-13 / -9%; 84% of the H100's 4-bit read bound for NVFP4), 14% at 256 tokens; qwen3's
experts +6-10% at 64 tokens, level at 256. A 256-K step undoes it (2.165 / 2.089), so the
default tiles keep 128-K steps for micro-tiled weights (configs.default_quant_config).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

ROWS, TILE_BYTES = 16, 64  # micro_offsets spells them out: a jitted body reads no globals
MICRO_K = 2 * TILE_BYTES  # K a tile row holds (two e2m1 a byte, eight nibbles an int32)
tl: Any = None  # triton.language, bound by jitted() (triton is imported on first use)


def micro_columns(dtype: torch.dtype) -> int:
    """MC: the packed columns of a micro-tile's row (64 uint8 bytes, 16 int32 words)."""
    return TILE_BYTES // dtype.itemsize


def is_micro(w: Any) -> bool:
    """Whether a quantized weight says its packed columns are micro-tiled."""
    return bool(getattr(w, "micro_tiled", False))


def to_micro(q: torch.Tensor) -> torch.Tensor:
    """[E, N, C] packed weights (row layout) -> the same shape in micro-tiles."""
    e, n, c = q.shape
    mc = micro_columns(q.dtype)
    if n % ROWS or c % mc:
        raise ValueError(f"micro-tiles need rows a multiple of {ROWS} and packed columns a "
                         f"multiple of {mc}, got [{e}, {n}, {c}] {q.dtype}")
    return (q.reshape(e, n // ROWS, ROWS, c // mc, mc).permute(0, 1, 3, 2, 4).contiguous()
            .reshape(e, n, c))


def from_micro(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_micro`: the row layout back."""
    e, n, c = q.shape
    mc = micro_columns(q.dtype)
    return (q.reshape(e, n // ROWS, c // mc, ROWS, mc).permute(0, 1, 3, 2, 4).contiguous()
            .reshape(e, n, c))


def micro_unfit(w: Any) -> str:
    """Why a quantized weight cannot be micro-tiled ("" when it can): the format (NVFP4 / INT4
    only), its row count or packed columns off the tile."""
    if w.format not in ("nvfp4", "int4"):
        return f"{w.format} weights are not packed 4-bit"
    if w.qweight.dim() != 3:
        return f"{list(w.shape)} is not a stack of experts"
    *_, n, c = w.qweight.shape
    mc = micro_columns(w.qweight.dtype)
    if n % ROWS or c % mc:
        return (f"{list(w.shape)} needs rows a multiple of {ROWS} and K a multiple of "
                f"{MICRO_K}")
    return ""


def fits_shape(fmt: str, hidden: int, inter: int) -> bool:
    """Whether experts of this format and shape (w13 [E, 2I, H], w2 [E, H, I]) can be
    micro-tiled: `micro_unfit`'s rule from the shape alone (the tuner's random experts)."""
    return fmt in ("nvfp4", "int4") and hidden % MICRO_K == 0 and inter % MICRO_K == 0


def tile_in_place(w: Any) -> None:
    """A quantized weight's [E, N, C] packed columns rewritten as micro-tiles in place, one
    expert at a time (a transient of one expert's bytes: a whole GLM-5 layer is 4.8 GB), and
    `w.micro_tiled` set. Raises ValueError where `micro_unfit` names a reason."""
    why = micro_unfit(w)
    if why:
        raise ValueError(f"cannot micro-tile: {why}")
    if is_micro(w):
        return
    q = w.qweight.data
    for e in range(q.shape[0]):
        q[e].copy_(to_micro(q[e:e + 1])[0])
    w.micro_tiled = True


def micro_offsets(rows, cols, C, MC: tl.constexpr):
    """Element offsets in one expert's micro-tiled weight of rows [1, BN] and packed columns
    [BC, 1] (C: the packed columns a row): a Triton helper (fused_triton jits it)."""
    return (rows // 16) * (16 * C) + (rows % 16) * MC + (cols // MC) * (16 * MC) + cols % MC


def micro_arg(fmt: str, w: Any, qweight: torch.Tensor) -> int:
    """The fused kernel's MICRO: the packed columns of a micro-tile's row where the weight says
    it is micro-tiled (`w.micro_tiled`, NVFP4 / INT4 only), else 0 (the row layout)."""
    if not is_micro(w):
        return 0
    if fmt not in ("nvfp4", "int4"):
        raise ValueError(f"micro-tiled weights are NVFP4 / INT4 only, got {fmt}")
    return micro_columns(qweight.dtype)


def packed_offsets(rows, cols, stride_row, stride_col, MICRO: tl.constexpr):
    """Element offsets of 4-bit packed weights at rows and packed columns broadcast against
    each other (the fused MoE's [BC, BN] tile, the dequantize kernel's [BN, BC]): strided, or
    (MICRO > 0) micro-tiles (stride_row: the columns a row)."""
    if MICRO > 0:
        offs = micro_offsets(rows, cols, stride_row, MICRO)
    else:
        offs = rows * stride_row + cols * stride_col
    return offs


@functools.cache
def jitted() -> SimpleNamespace:
    """The Triton helpers (bound here as module globals too: packed_offsets calls
    micro_offsets by name); triton is imported here, on first use (once: the fused MoE and the
    dequantize kernel both take them)."""
    global tl, micro_offsets, packed_offsets
    import triton
    import triton.language

    tl = triton.language
    micro_offsets, packed_offsets = (triton.jit(f) for f in (micro_offsets, packed_offsets))
    return SimpleNamespace(packed_offsets=packed_offsets)
