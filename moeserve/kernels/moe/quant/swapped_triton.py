"""The NVFP4 fused MoE's output tile with the product transposed (an experiment, off until the
H200 times it): `_tile_swapped`, fused_triton._tile's contract for FORMAT nvfp4, computing
out^T[n-tile, pairs] = W[n-tile, K] @ x[pairs, K]^T.

Why: fused_triton._tile dots x [BLOCK_M, BK] with the dequantized weight [BK, BLOCK_N], the
weight as B. On sm90 Triton gives that mma.sync (HMMA): B comes from registers (the decode's),
and its 16-row tiles of tokens are HMMA's M (Triton 3.6's SASS of the 16 x 64 x 128 gated tile:
32 HMMA and 27 LDS a K step beside the decode's ~400 instructions). With the weight as A and the
tokens as N, wgmma can take it: its M is the weight rows (64 a warpgroup), its N the row
block's tokens (8-256), and A may come from registers, as the decode leaves it. vLLM's and
SGLang's Hopper W4A16 kernels (Marlin / Machete) put the weights in that place.

    program (row block, N-tile): pairs = the block's BLOCK_M sorted pairs, rows = BLOCK_N weight
    rows; a K step loads the weight's packed bytes as [BLOCK_N, BK / 2] (contiguous along K, as
    stored) and their e4m3 group scales as [BLOCK_N, BK / 16], decodes each nibble with
    linear/nvfp4_tile's decode (`nvfp4_step_t`: the same bits), and dots them with x's even
    and odd columns, transposed ([BK / 2, BLOCK_M]); the epilogue applies the global scales
    per weight row and (gated) silu(gate) * up, or the routing weights per pair, and stores
    the tile transposed.

Selected by fused_triton.swap_ab (MOESERVE_NVFP4_SWAP_AB=1, envs.py) for nvfp4 tiles of
BLOCK_N >= 64; the same sums up to their order (tests compare it with the unswapped tile).

Offline (Triton 3.6's sm90 SASS, kernel_sass moe-quant --swap-ab, "asm" decode, a K step of
the gated launch): wgmma it gets (16 x 64 x 128: 16 HGMMA for 32 HMMA), but Triton converts
the decoded tile into wgmma's A-operand register layout with byte permutes (PRMT 64 -> 180),
so the loop grows from 534 to 759 instructions; the 64 x 128 x 128 tile (1,024 tokens) from
957 to 1,583, with 172 bytes of spill. In the decode's instruction-bound regime that predicts
it slower; the H200 has the last word. What would remove the permutes is a decode whose
output lands in the A fragment's layout directly (the weight bytes re-laid at load, as
Marlin does, or a Gluon kernel that names the layouts).
"""

from __future__ import annotations

from typing import Any

tl: Any = None  # triton.language, bound by fused_triton._kernel() (with the helpers below)
_nvfp4_step_t: Any = None
_e4m3_bits_to_f32: Any = None
_unscale: Any = None

MIN_BLOCK_N = 64  # wgmma's M: a warpgroup's 64 weight rows


def _tile_swapped(a_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                  pid_m, pid_n, expert, num_pairs, N, K, stride_am,
                  stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sk,
                  stride_ge, stride_gn, stride_cm,
                  GROUP: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                  EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr,
                  DECODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """One [BLOCK_N, BLOCK_M] transposed output tile of row block pid_m (expert `expert`,
    int64), nvfp4 (the module docstring)."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    row_ok = pairs < num_pairs  # padding holds the sentinel num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    rows = (offs_n % N).to(tl.int64)  # [BN] weight rows: in bounds unmasked
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am  # [BM, 1]; A's last dim is contiguous
    b_base = b_ptr + expert * stride_be
    s_base = bs_ptr + expert * stride_se
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, dtype=tl.float32)  # out^T
    acc_up = tl.full((BLOCK_N, BLOCK_M), 0.0, dtype=tl.float32)  # the up rows' (gated)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BK]
        if EVEN_K:
            a = tl.load(a_base + kk[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BK]
        else:
            a = tl.load(a_base + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :],
                        other=0.0)
        acc = _w_step(acc, a, b_base, s_base, rows, k0, K, stride_bn, stride_bk, stride_sn,
                      stride_sk, GROUP, EVEN_K, DOT_PRECISION, NATIVE_FP8, DECODE, BLOCK_M,
                      BLOCK_K)
        if GATED:  # the up rows N + n: their own scales
            acc_up = _w_step(acc_up, a, b_base, s_base, rows + N, k0, K, stride_bn,
                             stride_bk, stride_sn, stride_sk, GROUP, EVEN_K, DOT_PRECISION,
                             NATIVE_FP8, DECODE, BLOCK_M, BLOCK_K)
    # the global scales, per weight row (gate and up rows their own)
    g_rows = bg_ptr + expert * stride_ge + rows * stride_gn  # [BN]
    acc = acc * (tl.load(g_rows) * _unscale(DECODE))[:, None]
    if GATED:
        acc_up = acc_up * (tl.load(g_rows + N * stride_gn) * _unscale(DECODE))[:, None]
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    else:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[None, :]
    c_ptrs = c_ptr + pairs.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_n < N)[:, None])


def _w_step(acc, a, b_base, s_base, rows, k0, K, stride_bn, stride_bk, stride_sn, stride_sk,
            GROUP: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
            NATIVE_FP8: tl.constexpr, DECODE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """acc^T [BN, BM] + the dequantized [BN, BK] tile of weight rows `rows` at columns k0 ..
    k0 + BK @ a [BM, BK]^T (x's columns)."""
    c = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte columns
    byte = _load_n(b_base + rows[:, None] * stride_bn + c[None, :] * stride_bk, c * 2 < K,
                   EVEN_K)  # [BN, BK / 2] uint8, contiguous along K
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # [BK / G] group columns
    s_ptrs = s_base + rows[:, None] * stride_sn + g[None, :] * stride_sk  # [BN, BK / G]
    if NATIVE_FP8:  # float8_e4m3fn, the hardware's conversion
        scale = _load_n(s_ptrs, g * GROUP < K, EVEN_K).to(tl.float32)
    else:  # its bytes (the interpreter's fp8 loads lose the NaN codes)
        scale = _e4m3_bits_to_f32(_load_n(s_ptrs, g * GROUP < K, EVEN_K).to(tl.int32))
    return _nvfp4_step_t(acc, a, byte, scale, BLOCK_M, BLOCK_K, DOT_PRECISION, DECODE)


def _load_n(ptrs, k_ok, EVEN_K: tl.constexpr):
    """A [BN, BK'] tile; columns past K (not EVEN_K) load 0."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_ok[None, :], other=0.0)
