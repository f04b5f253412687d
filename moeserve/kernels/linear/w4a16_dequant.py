"""W4A16 linear for many tokens: the 4-bit weight dequantized once into x's dtype by a Triton
kernel, then one cuBLAS GEMM with an fp32 result, and the choice between that and the fused
kernel of w4a16_triton.py.

    w4a16_linear(x, fmt, qweight, scale, global_scale, group, k, bias)
        the engine's entry: "dequant" (below) when `choose_w4a16_backend` says so, else
        w4a16_linear_triton (the weight dequantized tile by tile inside the GEMM)
    w4a16_linear_dequant(...)      x [T, K] @ dequantize_w4a16(...)[N, K].T -> [T, N]
    dequantize_w4a16(fmt, qweight, scale, group, k, dtype) -> [N, K] in dtype

Why: the fused kernel decodes the weight again for every BLOCK_M rows of x, so its time grows
with the tokens: on the H200 at qwen3-30b-a3b's qkv (N 5,120, K 2,048) 0.019 / 0.084 / 0.205 ms
at 64 / 256 / 1,024 tokens, 0.7-2.6% of its weight-read bound from 256 tokens on
(benchmarks/results/gpu_04e1157). Decoding once costs a write and a read of the weight in x's
dtype (2 + 2 bytes a weight beside the 0.5625 read), about 10 us for that qkv, after which the
GEMM runs at cuBLAS's rate. vLLM's AWQ makes the same switch (dequantize, then matmul) from 256
tokens. Below AUTO_DEQUANT_MIN_TOKENS the fused kernel reads the weight once and wins.

The dequantized tile is the fused kernel's, bit for bit: NVFP4 e2m1 x e4m3 (at most 7
significant bits in [2^-10, 2688]: exact in fp16 and bf16; the global scale is not applied),
INT4 (nibble - 8) x scale in fp32 and then cast to x's dtype. NVFP4's GEMM returns fp32
(`torch.mm(..., out_dtype=torch.float32)` on CUDA) and `scale_columns` applies its global scale
and the bias in fp32 and rounds to x's dtype once, in one pass; INT4's (no global scale) is
cuBLAS's GEMM in x's dtype, the bias added to its fp32 sums: either way one rounding, as in
the fused kernel, and only the order of the fp32 sums differs. On CPU (tests,
TRITON_INTERPRET=1) the matmul runs in fp32.

Launch shapes depend on the weight's shape only, so a CUDA graph captures the whole op; the
[N, K] workspace comes from the caching allocator (a graph's pool reuses it from layer to
layer).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.linear import nvfp4_tile
from moeserve.kernels.linear.w4a16_triton import (
    check_w4a16_weight,
    check_w4a16_x,
    w4a16_linear_triton,
)
from moeserve.kernels.moe.quant import micro_tiles
from moeserve.quant.int4_pack import PER_WORD

tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global
BACKENDS = ("auto", "fused", "dequant")
# From this many tokens "auto" dequantizes first (module doc). Measured on the H200 for NVFP4
# (benchmarks/results/gpu_71bb695/call1_65126ca, kernels_quant --w4a16-backend fused dequant,
# four projection shapes): at 64 tokens the fused kernel is faster (qwen3 qkv 0.016 against
# 0.021 ms), at 256 dequantizing is 2.7-3.7x faster (0.030 against 0.080 ms), at 1,024 3-4.7x;
# INT4's dequant side failed to compile in that run (fixed at 9b3c541), not yet timed.
AUTO_DEQUANT_MIN_TOKENS = 128
# The backend the engine's linear layers use: "auto" or one of the two (benchmarks set it).
backend = "auto"
_BLOCK_N = 32  # weight rows a program
_BLOCK_K = 128  # weight columns a program (a multiple of every group: 16, int4's <= 128)
_EPILOGUE_T, _EPILOGUE_N = 32, 128  # scale_columns' tile


def w4a16_linear(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scale: torch.Tensor,
                 global_scale: torch.Tensor | None, group: int, k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] through a 4-bit weight [N, K] -> [..., N] in x's dtype, on the backend
    `choose_w4a16_backend` picks (arguments as w4a16_linear_triton's)."""
    num_tokens = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if choose_w4a16_backend(num_tokens, x.device, x.dtype, group) == "dequant":
        return w4a16_linear_dequant(x, fmt, qweight, scale, global_scale, group, k, bias)
    return w4a16_linear_triton(x, fmt, qweight, scale, global_scale, group, k, bias)


def choose_w4a16_backend(num_tokens: int, device: torch.device, x_dtype: torch.dtype,
                         group: int, choice: str | None = None) -> str:
    """"fused" or "dequant" for one call. choice (default: the module's `backend`) "auto" is
    "dequant" on CUDA from AUTO_DEQUANT_MIN_TOKENS tokens where cuBLAS gives an fp32 result
    from x's dtype, else "fused"; ValueError names an unknown choice or a "dequant" that
    cannot run."""
    choice = backend if choice is None else choice
    if choice not in BACKENDS:
        raise ValueError(f"w4a16 linear backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "fused":
        return "fused"
    unfit = dequant_unfit(group)
    if choice == "dequant":
        if unfit is not None:
            raise ValueError(f"w4a16 linear: the dequant path cannot run: {unfit}")
        return "dequant"
    runs = (device.type == "cuda" and unfit is None and num_tokens >= AUTO_DEQUANT_MIN_TOKENS
            and fp32_result_mm(device, x_dtype))
    return "dequant" if runs else "fused"


def dequant_unfit(group: int) -> str | None:
    """Why the dequant kernel cannot take this group, or None."""
    if _BLOCK_K % group:
        return f"group {group} does not divide its {_BLOCK_K}-column tile"
    return None


@functools.cache
def fp32_result_mm(device: torch.device, x_dtype: torch.dtype) -> bool:
    """Whether torch.mm gives an fp32 result from two x_dtype operands on device (cuBLAS's
    `out_dtype`; fp32 operands always)."""
    if x_dtype == torch.float32:
        return True
    try:
        a = torch.ones(2, 16, dtype=x_dtype, device=device)
        out = torch.mm(a, a.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.dtype == torch.float32 and bool((out == 16).all())


def w4a16_linear_dequant(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scale: torch.Tensor,
                         global_scale: torch.Tensor | None, group: int, k: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ the dequantized weight [N, K].T (module doc) -> [..., N] in x's dtype;
    ValueError names a wrong dtype, shape or device."""
    n = check_w4a16_weight(fmt, qweight, scale, global_scale, group, k)
    check_w4a16_x(x, k, n, bias, (qweight, scale, global_scale))
    rows = x.reshape(-1, k)  # [T, K]
    w = dequantize_w4a16(fmt, qweight, scale, group, k, x.dtype)  # [N, K]
    g = global_scale if fmt == "nvfp4" else None
    if x.dtype == torch.float32:
        out = rows @ w.t()
        if g is not None:
            out.mul_(g)
        if bias is not None:
            out.add_(bias)
    elif x.is_cuda and g is None:  # cuBLAS adds the bias to its fp32 sums and rounds once
        out = torch.mm(rows, w.t()) if bias is None else torch.addmm(bias, rows, w.t())
    else:  # fp32 sums, then x g + bias and the one rounding in a single pass
        acc = (torch.mm(rows, w.t(), out_dtype=torch.float32) if x.is_cuda
               else rows.float() @ w.float().t())  # [T, N]
        out = scale_columns(acc, g, bias, x.dtype)
    return out.reshape(*x.shape[:-1], n)


def scale_columns(acc: torch.Tensor, g: torch.Tensor | None, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """acc [T, N] fp32 (contiguous) -> (acc * g[n] + bias[n]) in dtype, computed in fp32 (on
    the GPU one FMA, so the fp32 value may differ from torch's mul then add in its last bit:
    the GPU test) and rounded once, in one Triton pass (the GEMM's epilogue: a mul_, an add_
    and a cast were three passes over the fp32 [T, N], 1.6 + 1.0 ms of a 61 ms glm-5 NVFP4
    decode step on an H100, benchmarks/results/gpu_03209dd/call5)."""
    t, n = acc.shape
    out = torch.empty(t, n, dtype=dtype, device=acc.device)
    if t and n:
        grid = (math.ceil(t / _EPILOGUE_T), math.ceil(n / _EPILOGUE_N))
        _kernels().scale_columns[grid](
            acc, acc if g is None else g, acc if bias is None else bias, out, t, n,
            acc.stride(0), out.stride(0), HAS_G=g is not None, HAS_BIAS=bias is not None,
            BLOCK_T=_EPILOGUE_T, BLOCK_N=_EPILOGUE_N, num_warps=4)
    return out


def dequantize_w4a16(fmt: str, qweight: torch.Tensor, scale: torch.Tensor, group: int, k: int,
                     dtype: torch.dtype, global_scale: torch.Tensor | None = None,
                     micro: int = 0) -> torch.Tensor:
    """The weight [..., N, K] in dtype by the Triton kernel (interpreted on CPU): NVFP4 without
    its global scale (module doc), or with it, global_scale [..., N] fp32 multiplied in fp32
    before the one rounding to dtype (no longer exact: the MoE's dequant path); leading dims
    (a MoE block's experts) flattened into the rows. micro: qweight is micro-tiled
    (kernels/moe/quant/micro_tiles.py) with this many packed columns a tile row (its
    `micro_arg`), contiguous; 0 for the row layout."""
    unfit = dequant_unfit(group)
    if unfit is not None:
        raise ValueError(f"w4a16 dequantize: {unfit}")
    *lead, n = qweight.shape[:-1]
    rows_q, rows_s = qweight.reshape(-1, qweight.shape[-1]), scale.reshape(-1, scale.shape[-1])
    rows = rows_q.shape[0]
    out = torch.empty(rows, k, dtype=dtype, device=qweight.device)
    if rows and k:
        nvfp4 = fmt == "nvfp4"
        native_fp8 = qweight.device.type == "cuda"
        s = rows_s.view(torch.uint8) if nvfp4 and not native_fp8 else rows_s
        g = global_scale.reshape(-1) if global_scale is not None else out  # unused without
        grid = (math.ceil(rows / _BLOCK_N), math.ceil(k / _BLOCK_K))
        _kernels().dequant[grid](
            rows_q, s, g, out, rows, k, rows_q.stride(0), rows_q.stride(1), s.stride(0),
            s.stride(1), out.stride(0), out.stride(1),
            NVFP4=nvfp4, GROUP=group, NATIVE_FP8=native_fp8, MICRO=micro,
            HAS_GLOBAL=global_scale is not None, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
            PER_WORD=PER_WORD, num_warps=4)  # a constexpr argument: compiled Triton reads
        # no plain Python global (the interpreter does, so only the GPU run caught it)
    return out.reshape(*lead, n, k)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _e4m3_bits_to_f32, _nibble_values, _packed_offsets
    import triton
    import triton.language

    tl = triton.language
    tiles = nvfp4_tile.jitted()  # the kernel calls them by these global names
    _e4m3_bits_to_f32, _nibble_values = tiles.e4m3_bits_to_f32, tiles.nibble_values
    _packed_offsets = micro_tiles.jitted().packed_offsets
    return SimpleNamespace(dequant=triton.jit(_dequant_kernel),
                           scale_columns=triton.jit(_scale_columns_kernel))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _dequant_kernel(q_ptr, s_ptr, g_ptr, out_ptr, N, K, stride_qn, stride_qk, stride_sn,
                    stride_sk, stride_on, stride_ok, NVFP4: tl.constexpr, GROUP: tl.constexpr,
                    NATIVE_FP8: tl.constexpr, HAS_GLOBAL: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PER_WORD: tl.constexpr, MICRO: tl.constexpr = 0):
    """Program (n tile, k tile): out[n, k] for BLOCK_N rows and BLOCK_K columns (module doc);
    HAS_GLOBAL: times g[n] (contiguous fp32) before the cast; PER_WORD: int4 values a word;
    MICRO: the packed columns of a micro-tile's row (rows of 16 within the flattened experts:
    N % 16 == 0), 0 for the row layout."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    rows = rn.to(tl.int64)[:, None]  # [BN, 1]
    g = k0 // GROUP + tl.arange(0, GROUPS)  # [G] scale columns
    s_ptrs = s_ptr + rows * stride_sn + g[None, :] * stride_sk  # [BN, G]
    s_mask = n_ok[:, None] & (g * GROUP < K)[None, :]
    if NVFP4:  # the group scales, e4m3 [BN, G]
        if NATIVE_FP8:
            s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        else:  # its bytes (the interpreter's fp8 loads lose the NaN codes)
            s = _e4m3_bits_to_f32(tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32))
    else:
        s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    if NVFP4 and MICRO == 0:  # bytes 2j (low nibble) and 2j + 1 (high), K % 16 == 0
        c = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte columns
        byte = tl.load(q_ptr + _packed_offsets(rows, c[None, :], stride_qn, stride_qk, 0),
                       mask=n_ok[:, None] & (2 * c < K)[None, :], other=0).to(tl.int32)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, GROUP // 2)),
                       (BLOCK_N, BLOCK_K // 2)) * 16384.0  # a scale a byte; nibbles x 2^-14
        lo, hi = _nibble_values(byte)  # [BN, BK / 2] each: the e2m1 values x 2^-14
        w = tl.reshape(tl.join(lo * s, hi * s), (BLOCK_N, BLOCK_K))  # k = 2j + h
    else:  # int32 words, nibble i of word w at k = 8 w + i: INT4's (stored q + 8), and
        # micro-tiled NVFP4's bytes read as words (a byte's low nibble k = 2j, its high one
        # 2j + 1; a step's 16 words of a row are one tile row, adjacent and within K: read as
        # bytes, sm90 compiled a byte load each, 16 a thread against 4)
        c = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)  # [BK / 8] word columns
        if NVFP4:
            word = tl.load(q_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                           + _packed_offsets(rows, c[None, :], stride_qn // 4, 1, MICRO // 4),
                           mask=n_ok[:, None], other=0)
        else:
            word = tl.load(q_ptr + _packed_offsets(rows, c[None, :], stride_qn, stride_qk,
                                                   MICRO),
                           mask=n_ok[:, None] & (PER_WORD * c < K)[None, :], other=0)
        nib = (word[:, :, None] >> (tl.arange(0, PER_WORD) * 4)[None, None, :]) & 15
        nib = tl.reshape(nib, (BLOCK_N, BLOCK_K))
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, GROUP)),
                       (BLOCK_N, BLOCK_K))
        if NVFP4:  # a nibble is a byte's low one to _nibble_values: its value x 2^-14
            w = _nibble_values(nib)[0] * (s * 16384.0)
        else:
            w = (nib - 8).to(tl.float32) * s
    if HAS_GLOBAL:
        w = w * tl.load(g_ptr + rn, mask=n_ok, other=0.0)[:, None]
    rk = k0 + tl.arange(0, BLOCK_K)  # [BK]
    tl.store(out_ptr + rows * stride_on + rk[None, :] * stride_ok,
             w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (rk < K)[None, :])


def _scale_columns_kernel(acc_ptr, g_ptr, bias_ptr, out_ptr, T, N, stride_at, stride_ot,
                          HAS_G: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """Program (t tile, n tile) of `scale_columns`: acc fp32 [T, N] (unit column stride)."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    mask = (rt < T)[:, None] & n_ok[None, :]
    v = tl.load(acc_ptr + rt.to(tl.int64)[:, None] * stride_at + rn[None, :], mask=mask,
                other=0.0)
    if HAS_G:
        v = v * tl.load(g_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rt.to(tl.int64)[:, None] * stride_ot + rn[None, :],
             v.to(out_ptr.dtype.element_ty), mask=mask)
