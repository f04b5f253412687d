"""FP8 block-scaled W8A8 linear on Triton: the run-time activation quantization and the
block-scaled GEMM (Hopper's FP8 tensor cores), against quant/fp8_block.py's references.

    quantize_activations_triton(x)  x [T, K] -> (e4m3 [T, K], fp32 scales [T, ceil(K / 128)]):
                                    one program per (16 or 64 tokens, 128-group),
                                    s = max(amax / 448, 1e-12), q = e4m3(clamp(x / s)); the
                                    reference's ops in the reference's order, so the bytes
                                    are equal (optionally cuBLAS's padded, token-major scale
                                    layout: kernels/linear/fp8_cublas.py)
    w8a8_block_matmul_triton(...)   out[t, n] = sum over K blocks kb of
                                    (x_q[t, kb] . w_q[n, kb]) * s_x[t, kb] * s_w[n // r, kb]
                                    with r = scale_rows, 128 (the checkpoint's blocks) or 1
                                    (quant/packed.py's per-row scales):
                                    one BLOCK_M x BLOCK_N tile a program, K in 128-wide steps
                                    (one scale per step), the dot in fp32 on e4m3 inputs
    fp8_linear_triton(x, w, s)      the two, as `w8a8_linear_ref`

The GEMM sums each block's exact e4m3 products in the tensor cores' fp32 accumulator, so it
equals the reference up to fp32 summation order. Launch shapes depend on shapes only (no host
sync): CUDA-graph capturable. Triton is imported on first use (`_kernels`); on CPU the kernels
run under TRITON_INTERPRET=1 (tests). Its fp8 loads and dots are exact, but its fp32 -> e4m3
cast drops the carry into the exponent (124.3 becomes 64, not 128; Triton 3.6's interpreter), so
on CPU `fp8_linear_triton` quantizes activations with the torch reference and the GEMM alone
runs in Triton; the activation kernel is tested on the GPU.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.triton_common import num_sms, require_triton_device, split_k_for
from moeserve.quant.fp8_block import BLOCK, E4M3, E4M3_MAX, quantize_activations, scale_shape

tl: Any = None  # triton.language, bound by _kernels(): the kernels read it as a global
GROUP = BLOCK[1]  # K per activation scale and per weight-scale column
_MIN_SCALE = 1e-12  # as the reference's


def quantize_activations_triton(x: torch.Tensor, block_rows: int | None = None,
                                pad_rows_to: int = 1, mn_major_scales: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (fp32 / bf16 / fp16, unit last stride) -> (e4m3 [T, K], scales fp32
    [T, ceil(K / 128)]), equal to quant.fp8_block.quantize_activations.

    block_rows: tokens a program (None: 16 below 2,048 tokens, else 64: two variants, both
    compiled by a warm-up that runs a decode and a long prefill). For cuBLAS's layout
    (kernels/linear/fp8_cublas.py): pad_rows_to rounds the rows up (T_pad; the pad rows are
    quantized zeros, scale 1e-12) and mn_major_scales stores the scales token-major, shape
    [T_pad, G] with strides (1, T_pad)."""
    _need(x.dim() == 2 and x.is_floating_point(), f"x must be a 2-D float tensor, got "
          f"{x.dtype} {tuple(x.shape)}")
    require_triton_device(x.device, "quantize_activations_triton")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    groups = math.ceil(k / GROUP)
    rows = -(-t // pad_rows_to) * pad_rows_to
    q = torch.empty(rows, k, dtype=E4M3, device=x.device)  # [T_pad, K]
    scales = (torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
              if mn_major_scales else
              torch.empty(rows, groups, dtype=torch.float32, device=x.device))  # [T_pad, G]
    block_rows = block_rows or (16 if t < 2048 else 64)
    if rows and k:
        grid = (math.ceil(rows / block_rows), groups)
        _kernels().quantize[grid](x, q, scales, t, rows, k, x.stride(0), q.stride(0),
                                  scales.stride(0), scales.stride(1), BLOCK_ROWS=block_rows,
                                  GROUP=GROUP, FP8_MAX=E4M3_MAX, MIN_SCALE=_MIN_SCALE)
    return q, scales


def w8a8_block_matmul_triton(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                             w_scale: torch.Tensor, out_dtype: torch.dtype,
                             block_m: int | None = None, block_n: int = 128,
                             scale_rows: int = BLOCK[0],
                             split_k: int | None = None) -> torch.Tensor:
    """x_q e4m3 [T, K] with x_scale fp32 [T, ceil(K / 128)], w e4m3 [N, K] with w_scale
    [ceil(N / scale_rows), ceil(K / 128)] -> [T, N] in out_dtype. scale_rows: 128 (the
    checkpoint's blocks) or 1 (quant/packed.py's per-row layout, before
    `compact_fp8_scales`). block_m None: 16 up to 16 tokens, else 64; split_k None: on CUDA
    up to 64 tokens the split of K that brings the programs to about two an SM
    (w4a16_triton.split_k_for), else 1; with a split each split's fp32 partial sums are
    added in order after."""
    t, k = x_q.shape
    n = w.shape[0]
    _need(x_q.dtype == E4M3 and w.dtype == E4M3, f"x_q and w must be float8_e4m3fn, got "
          f"{x_q.dtype} and {w.dtype}")
    _need(w.dim() == 2 and w.shape[1] == k, f"w must be [N, {k}], got {tuple(w.shape)}")
    _need(tuple(x_scale.shape) == (t, math.ceil(k / GROUP)) and x_scale.dtype == torch.float32,
          f"x_scale must be fp32 [{t}, {math.ceil(k / GROUP)}], got {x_scale.dtype} "
          f"{tuple(x_scale.shape)}")
    _need(scale_rows in (1, BLOCK[0]), f"scale_rows must be 1 or {BLOCK[0]}, got {scale_rows}")
    want = scale_shape(n, k, (scale_rows, GROUP))
    _need(tuple(w_scale.shape) == want, f"w_scale must be {want} for w [{n}, {k}] with "
          f"scale_rows {scale_rows}, got {tuple(w_scale.shape)}")
    # NOTE: with 128-row scales a tile must not straddle two scale rows; per-row scales are
    # loaded per column of the tile, any block_n goes
    _need(scale_rows == 1 or (block_n <= BLOCK[0] and BLOCK[0] % block_n == 0),
          f"block_n {block_n} must divide {BLOCK[0]} (the scale rows)")
    for name, a in (("x_q", x_q), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale)):
        _need(a.device == x_q.device, f"{name} on {a.device}, x_q on {x_q.device}")
    require_triton_device(x_q.device, "w8a8_block_matmul_triton")
    w_scale = w_scale.float()
    block_m = block_m or (16 if t <= 16 else 64)
    if split_k is None:
        split_k = 1
        if x_q.device.type == "cuda" and t <= 64:
            split_k = split_k_for(math.ceil(t / block_m) * math.ceil(n / block_n),
                                  math.ceil(k / GROUP), num_sms(x_q.device))
    _need(isinstance(split_k, int) and split_k >= 1, f"split_k must be >= 1, got {split_k}")
    out = torch.empty(t, n, dtype=out_dtype, device=x_q.device)
    if t and n:
        dest = out if split_k == 1 else torch.empty(split_k, t, n, dtype=torch.float32,
                                                     device=x_q.device)
        grid = (math.ceil(t / block_m), math.ceil(n / block_n), split_k)
        _kernels().matmul[grid](
            x_q, w, dest, x_scale, w_scale, t, n, k,
            x_q.stride(0), x_q.stride(1), w.stride(0), w.stride(1), dest.stride(-2),
            dest.stride(-1), x_scale.stride(0), x_scale.stride(1), w_scale.stride(0),
            w_scale.stride(1), t * n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
            SCALE_ROWS=scale_rows, SPLIT_K=split_k)
        if split_k > 1:
            out.copy_(dest.sum(0))
    return out


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                      bias: torch.Tensor | None = None, scale_rows: int = BLOCK[0]
                      ) -> torch.Tensor:
    """x [..., K] through an FP8 block-scaled weight [N, K] -> [..., N] in x's dtype;
    scale_inv [ceil(N / scale_rows), ceil(K / 128)], scale_rows 128 or 1."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.device.type == "cpu":  # the interpreter's e4m3 cast is wrong (module docstring)
        x_q, x_scale = quantize_activations(rows)
    else:
        x_q, x_scale = quantize_activations_triton(rows)
    # with a bias: fp32 out, the bias added before the one rounding to x's dtype
    out = w8a8_block_matmul_triton(x_q, x_scale, weight, scale_inv,
                                   x.dtype if bias is None else torch.float32,
                                   scale_rows=scale_rows)
    if bias is not None:
        out = (out + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"fp8 linear: {what}")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    # the token count changes every step: no variant per value
    return SimpleNamespace(
        quantize=triton.jit(_quantize_kernel, do_not_specialize=["M", "M_STORE", "stride_sg"]),
        # not the row strides (the model's K and N): specialized, their divisibility by 16
        # lets the loads vectorize and pipeline (the fused MoE's NOTE, moe/quant/fused_triton)
        matmul=triton.jit(_matmul_kernel, do_not_specialize=["M", "split_stride"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ---

def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, M_STORE, K, stride_x, stride_q, stride_sm,
                     stride_sg, BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Program (row block, group): BLOCK_ROWS tokens' 128 values -> their e4m3 bytes and one
    scale a token. Rows in [M, M_STORE) (padding) read as zeros."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR]
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)  # [G]
    rows64 = rows.to(tl.int64)
    col_ok = cols < K
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :],
                mask=(rows < M)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)  # [BR]
    # NOTE: the reference's divisions, as torch runs them on the GPU: by the constant as `/`
    # (torch multiplies by the scalar's reciprocal; so does Triton here), by the scale as IEEE
    # division, div_rn (Triton's `/` is the approximate div.full.f32, an ulp off at times,
    # which moves a value across an e4m3 rounding boundary). Measured on the H200
    # (benchmarks/quant/fp8_quant_variants.py): these two give the reference's scales and bytes at
    # 4096 x 7168 exactly; `/` for the values leaves 7 bytes apart, div_rn for the scale
    # 124,625 scales
    scale = tl.maximum(amax / FP8_MAX, MIN_SCALE)  # [BR]
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    store = rows < M_STORE
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :],
             q.to(q_ptr.dtype.element_ty), mask=store[:, None] & col_ok[None, :])
    tl.store(s_ptr + rows64 * stride_sm + g * stride_sg, scale, mask=store)


def _matmul_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                   stride_asm, stride_ask, stride_bsn, stride_bsk, split_stride,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SCALE_ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (m tile, n tile): C[m, n] = sum over K steps of the e4m3 dot of A's and B's
    BLOCK_K columns times A's per-row and B's per-(row block) scales of that step."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # the K split: steps [kb_start, kb_end) of this program
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    kb_start = pid_s * per_split
    kb_end = tl.minimum(kb_start + per_split, steps)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok, n_ok = rm < M, rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am  # [BM, 1]
    b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn  # [1, BN]
    a_scale = as_ptr + rm.to(tl.int64) * stride_asm  # [BM]
    b_scale = bs_ptr + (rn // SCALE_ROWS) * stride_bsn  # [BN]: one scale row per SCALE_ROWS
    # 128-row scales: the tile's rows lie in one scale row (the launcher checks block_n), so
    # one scale a step, the two scales' product [BM], and one FFMA an accumulator where a
    # [BN] scale took an FMUL more (the MoE kernel's ONE_SCALE_ROW; the same bits)
    b_scale_one = bs_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK] e4m3
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [BK, BN] e4m3
        s_a = tl.load(a_scale + kb * stride_ask, mask=m_ok, other=0.0)  # [BM]
        if SCALE_ROWS > 1:
            acc += tl.dot(a, b) * (s_a * tl.load(b_scale_one + kb * stride_bsk))[:, None]
        else:
            s_b = tl.load(b_scale + kb * stride_bsk, mask=n_ok, other=0.0)  # [BN]
            acc += tl.dot(a, b) * (s_a[:, None] * s_b[None, :])
    c = (c_ptr + pid_s.to(tl.int64) * split_stride + rm.to(tl.int64)[:, None] * stride_cm
         + rn.to(tl.int64)[None, :] * stride_cn)
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
