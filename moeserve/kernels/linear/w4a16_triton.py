"""W4A16 linear on Triton: activations in their float dtype times a 4-bit weight held in
quant/packed.py's NVFP4 or INT4 layout, dequantized tile by tile inside the GEMM (Hopper has no
FP4 tensor cores; the dot runs in x's dtype with an fp32 accumulator).

    w4a16_linear_triton(x, fmt, qweight, scale, global_scale, group, k, bias)
        x [T, K] (or [..., K]) @ dequantize(...)[N, K].T -> [T, N] in x's dtype

    nvfp4  qweight uint8 [N, K / 2] (low nibble = even k), scale e4m3 [N, K / 16],
           global_scale fp32 [N]:   W[n, k] = e2m1(nibble) * e4m3(scale[n, k // 16]),
           and global_scale[n] multiplies accumulator column n in the epilogue (e2m1 x e4m3
           has at most 6 significant bits and lies in [2^-10, 2688]: exact in fp16 and bf16,
           so the tile cast to x's dtype rounds nothing)
    int4   qweight int32 [N, ceil(K / 8)] (k at bits 4 (k % 8) of word k // 8, stored q + 8),
           scale float [N, ceil(K / group)]:   W[n, k] = (nibble - 8) * scale[n, k // group],
           computed in fp32, then cast to x's dtype

One BLOCK_M x BLOCK_N output tile a program (and a K split: with SPLIT_K > 1, the default for small
T on CUDA, each of SPLIT_K programs of a tile sums its share of K's steps into an fp32 plane [S, T,
N], the planes then added in order and the bias after: decode has too few tiles to fill the SMs
otherwise); the K loop steps BLOCK_K (a multiple of the group) columns:
    nvfp4  the step's [BLOCK_K / 2, BLOCK_N] bytes and its [BLOCK_K / 16, BLOCK_N] group
           scales, each loaded once and spread over its group's 8 bytes in registers (a per-byte
           gather: 821 against 593 loop instructions at 16 x 64 x 128, split 4, sm90),
           dequantized and dotted by nvfp4_tile.nvfp4_step (x's even
           and odd columns against the low and high nibbles: no reshape of the weight tile;
           BLOCK_K >= 32)
    int4   the step's [BLOCK_K / 8, BLOCK_N] words, each shifted by every nibble's offset at
           once ([.., 8, BLOCK_N]) and masked, reshaped to the [BLOCK_K, BLOCK_N] nibble tile;
           the [BLOCK_K / group, BLOCK_N] scales broadcast along the group the same way
the product cast to x's dtype and dotted with x's tile (fp32 x: IEEE fp32 dot, no TF32). The bias
is added to the fp32 accumulator; one rounding to x's dtype at the store. When K is a multiple of
BLOCK_K (EVEN_K) the loads carry no mask along K, their contiguous axis, and so vectorize into
the cp.async pipeline: masked there, every weight byte was a load of its own (sm90 SASS at 16 x
64 x 128, split 4: 593 -> 369 loop instructions, 36 -> 0 synchronous loads;
benchmarks/results/sass_nvfp4_scales).

NVFP4's e4m3 scales: on CUDA loaded as float8_e4m3fn and converted by the hardware; on CPU read as
their bytes (`scale.view(torch.uint8)`) and decoded by bit arithmetic (NaN codes 0x7F / 0xFF give
NaN, as torch's cast does): measured under Triton's interpreter (3.9), loading float8_e4m3fn is
exact for the 254 finite codes but turns the NaN codes into +-480.

Launch shapes depend on shapes only (no host sync): CUDA-graph capturable. The token count (and
the split planes' stride, T x N) are `do_not_specialize`, so a new batch size compiles nothing;
the row strides (the model's K and N) are specialized, so that their divisibility by 16 lets
the loads vectorize and pipeline; the default tile
(`_default_config`) depends on T in three buckets, `config=` overrides it (a tuner's entry).
Triton is imported on first use (`_kernels`); on CPU the kernel runs under TRITON_INTERPRET=1
(tests), in fp32 and fp16 only: the interpreter mishandles bf16 (bf16 runs on the GPU).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.linear import nvfp4_tile
from moeserve.kernels.triton_common import num_sms, require_triton_device, split_k_for
from moeserve.quant.fp8_block import E4M3
from moeserve.quant.int4_pack import PER_WORD
from moeserve.quant.nvfp4 import GROUP as NVFP4_GROUP

tl: Any = None  # triton.language, bound by _kernels(): the kernels read it as a global
FORMATS = ("nvfp4", "int4")
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K")
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def w4a16_linear_triton(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scale: torch.Tensor,
                        global_scale: torch.Tensor | None, group: int, k: int,
                        bias: torch.Tensor | None = None,
                        config: dict[str, int] | None = None) -> torch.Tensor:
    """x [..., K] through a 4-bit weight of logical shape [N, K] -> [..., N] in x's dtype.

    Args:
        x: fp32 / fp16 / bf16 [..., K] (bf16 on CUDA only).
        fmt: "nvfp4" or "int4"; qweight, scale, global_scale as quant/packed.py lays them out
            for a 2-D weight (global_scale None for int4).
        group: K per scale column (16 for nvfp4; int4: a power of two, a multiple of 8).
        k: the logical K (int4's last word may be partly padding).
        bias: float [N], added in fp32 before the one rounding to x's dtype.
        config: override of the tile (keys CONFIG_KEYS; BLOCK_* powers of two >= 16, BLOCK_K a
            multiple of the group).
    Returns:
        [..., N] in x's dtype, a new tensor. ValueError names a wrong dtype, shape or config.
    """
    n = check_w4a16_weight(fmt, qweight, scale, global_scale, group, k)
    check_w4a16_x(x, k, n, bias, (qweight, scale, global_scale))
    rows = x.reshape(-1, k)  # [T, K]
    t = rows.shape[0]
    cfg = _resolve_config(t, n, k, group, x.device, config)
    _need(fmt != "nvfp4" or cfg["BLOCK_K"] >= nvfp4_tile.MIN_BLOCK_K,
          f"config BLOCK_K {cfg['BLOCK_K']}: nvfp4 needs at least {nvfp4_tile.MIN_BLOCK_K} "
          "(each nibble's dot spans half of it)")
    split = cfg["SPLIT_K"]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)  # [T, N]
    if t and n:
        nvfp4 = fmt == "nvfp4"
        native_fp8 = x.device.type == "cuda"  # nvfp4's scales loaded as float8 (or bytes)
        s = scale.view(torch.uint8) if nvfp4 and not native_fp8 else scale  # [N, K / 16]
        g = global_scale if nvfp4 else s  # [N] fp32 (int4: unused, any pointer)
        b = bias if bias is not None else out  # [N] (unused without HAS_BIAS)
        # split-K: each split's fp32 partial sums [S, T, N], added in a fixed order after
        dest = out if split == 1 else torch.empty(split, t, n, dtype=torch.float32,
                                                  device=x.device)
        grid = (math.ceil(t / cfg["BLOCK_M"]), math.ceil(n / cfg["BLOCK_N"]), split)
        _kernels().w4a16[grid](
            rows, qweight, s, g, b, dest, t, n, k,
            rows.stride(0), rows.stride(1), qweight.stride(0), qweight.stride(1),
            s.stride(0), s.stride(1), g.stride(0), b.stride(0), dest.stride(-2),
            dest.stride(-1), t * n,
            NVFP4=nvfp4, GROUP=group, HAS_BIAS=bias is not None and split == 1,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            NATIVE_FP8=native_fp8,
            DECODE=nvfp4_tile.decode_id(x.dtype, x.device) if nvfp4 else 0,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, EVEN_K=k % cfg["BLOCK_K"] == 0,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        if split > 1:
            total = dest.sum(0)  # [T, N] fp32
            if bias is not None:
                total += bias.float()
            out.copy_(total)
    return out.reshape(*x.shape[:-1], n)


def _default_config(t: int, n: int, k: int, group: int, device: torch.device) -> dict[str, int]:
    """The tile for T tokens: decode-sized M tiles for small T (the weight read dominates), and
    for small T on CUDA a split of K (SPLIT_K, each split at least 4 steps) that brings the
    programs to about two per SM: at T 16, N 2,048 and BLOCK_N 64 there are 32 tiles, a quarter
    of an H200's 132 SMs, each reading all of K alone.

    NOTE: untuned. Measured once on an H200 (bf16, N 4096, K 7168): these run decode in 192 us
    (nvfp4) / 104 us (int4), T 512 in 588 / 316 us; the best of a small sweep was about 2x
    faster (T 1: BLOCK_N 16-32, BLOCK_K 256; T 512: num_warps 4) and still far from the
    weight's read time (a bf16 dense GEMM of the same shape: 27 us). A tuner's job (`config`).
    """
    bk = max(128, group)
    if t <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    elif t <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, num_warps=8, num_stages=3)
    cfg["SPLIT_K"] = 1
    if device.type == "cuda" and t <= 64:
        tiles = math.ceil(t / cfg["BLOCK_M"]) * math.ceil(n / cfg["BLOCK_N"])
        cfg["SPLIT_K"] = split_k_for(tiles, math.ceil(k / bk), num_sms(device))
    return cfg


def _resolve_config(t: int, n: int, k: int, group: int, device: torch.device,
                    config: dict[str, int] | None) -> dict[str, int]:
    cfg = _default_config(t, n, k, group, device)
    if config is None:
        return cfg
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    _need(not unknown, f"unknown config keys {unknown} (known: {list(CONFIG_KEYS)})")
    cfg.update(config)
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        _need(isinstance(v, int) and v >= 16 and v & (v - 1) == 0,
              f"config {key} must be a power of two >= 16, got {v}")
    _need(cfg["BLOCK_K"] % group == 0, f"config BLOCK_K {cfg['BLOCK_K']} must be a multiple of "
          f"the group {group}")

    w, s = cfg["num_warps"], cfg["num_stages"]
    _need(isinstance(w, int) and w >= 1 and w & (w - 1) == 0,
          f"config num_warps must be a power of two, got {w}")
    _need(isinstance(s, int) and s >= 1, f"config num_stages must be >= 1, got {s}")
    split = cfg["SPLIT_K"]
    _need(isinstance(split, int) and split >= 1, f"config SPLIT_K must be >= 1, got {split}")
    return cfg


def check_w4a16_weight(fmt: str, qweight: torch.Tensor, scale: torch.Tensor,
                  global_scale: torch.Tensor | None, group: int, k: int) -> int:
    """The packed tensors against packed.py's layout for [N, k]; returns N."""
    _need(fmt in FORMATS, f"fmt must be one of {FORMATS}, got {fmt!r}")
    _need(qweight.dim() == 2, f"qweight must be 2-D [N, packed K], got {tuple(qweight.shape)}")
    n = qweight.shape[0]
    if fmt == "nvfp4":
        _need(group == NVFP4_GROUP, f"nvfp4's group is {NVFP4_GROUP}, got {group}")
        _need(k % NVFP4_GROUP == 0, f"nvfp4 needs K a multiple of {NVFP4_GROUP}, got {k}")
        _need(qweight.dtype == torch.uint8 and qweight.shape[1] == k // 2,
              f"nvfp4 qweight must be uint8 [{n}, {k // 2}], got {qweight.dtype} "
              f"{tuple(qweight.shape)}")
        _need(scale.dtype == E4M3 and tuple(scale.shape) == (n, k // NVFP4_GROUP),
              f"nvfp4 scale must be float8_e4m3fn [{n}, {k // NVFP4_GROUP}], got "
              f"{scale.dtype} {tuple(scale.shape)}")
        got = None if global_scale is None else (global_scale.dtype, tuple(global_scale.shape))
        _need(global_scale is not None and global_scale.dtype == torch.float32
              and tuple(global_scale.shape) == (n,),
              f"nvfp4 global_scale must be fp32 [{n}], got {got}")
        return n
    _need(group > 0 and group % PER_WORD == 0 and group & (group - 1) == 0,
          f"int4's group must be a power of two and a multiple of {PER_WORD}, got {group}")
    words, groups = math.ceil(k / PER_WORD), math.ceil(k / group)
    _need(qweight.dtype == torch.int32 and qweight.shape[1] == words,
          f"int4 qweight must be int32 [{n}, {words}] for K {k}, got {qweight.dtype} "
          f"{tuple(qweight.shape)}")
    _need(scale.is_floating_point() and scale.element_size() >= 2
          and tuple(scale.shape) == (n, groups),
          f"int4 scale must be float [{n}, {groups}] (groups of {group}), got {scale.dtype} "
          f"{tuple(scale.shape)}")
    _need(global_scale is None, "int4 takes no global_scale (got a tensor)")
    return n


def check_w4a16_x(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None,
             weights: tuple[torch.Tensor | None, ...]) -> None:
    _need(x.dtype in _X_DTYPES, f"x must be fp32 / fp16 / bf16, got {x.dtype}")
    _need(x.dim() >= 1 and x.shape[-1] == k, f"x must be [..., {k}], got {tuple(x.shape)}")
    if bias is not None:
        _need(bias.is_floating_point() and tuple(bias.shape) == (n,),
              f"bias must be float [{n}], got {bias.dtype} {tuple(bias.shape)}")
    for a in (*weights, bias):
        _need(a is None or a.device == x.device, f"a weight tensor on {getattr(a, 'device', '')}"
              f", x on {x.device}")
    require_triton_device(x.device, "w4a16_linear_triton")
    _need(x.device.type != "cpu" or x.dtype != torch.bfloat16,
          "bf16 x is not supported on CPU (Triton's interpreter mishandles bf16); use fp32 / "
          "fp16 on CPU, bf16 on the GPU")


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"w4a16 linear: {what}")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel and its helpers, once (interpreted if
    TRITON_INTERPRET=1 now)."""
    global tl, _nvfp4_step, _e4m3_bits_to_f32, _spread_groups, _unscale
    import triton
    import triton.language

    tl = triton.language
    tiles = nvfp4_tile.jitted()  # the kernel calls them by these global names
    _nvfp4_step, _e4m3_bits_to_f32 = tiles.nvfp4_step, tiles.e4m3_bits_to_f32
    _spread_groups, _unscale = tiles.spread_groups, tiles.unscale
    # the token count changes every step: no variant per value
    return SimpleNamespace(w4a16=triton.jit(
        _w4a16_kernel, do_not_specialize=["M", "split_stride"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ---

def _w4a16_kernel(x_ptr, q_ptr, s_ptr, g_ptr, bias_ptr, out_ptr, M, N, K,
                  stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sk,
                  stride_g, stride_bias, stride_om, stride_on, split_stride,
                  NVFP4: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr, DECODE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (m tile, n tile, split): out[m, n] = sum over the split's K steps of x's
    [BM, BK] tile dotted with the dequantized [BK, BN] weight tile (module docstring), then the
    epilogue; with SPLIT_K > 1 the fp32 partial goes to its split's plane of out (split_stride
    apart), summed on the host side after."""
    GROUPS_PER_STEP: tl.constexpr = BLOCK_K // GROUP
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    kb_start = pid_s * per_split
    kb_end = tl.minimum(kb_start + per_split, steps)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    rg = tl.arange(0, GROUPS_PER_STEP)  # [BK / G]
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn  # [1, BN]
    s_cols = s_ptr + rn.to(tl.int64)[None, :] * stride_sn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * BLOCK_K + rk  # [BK]
        # EVEN_K (K a multiple of BLOCK_K): no mask along K, the loads' contiguous axis, so
        # that they vectorize (a per-byte mask there made every weight byte its own LDG)
        k_ok = (k < K) | EVEN_K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK] x's dtype
        if NVFP4:  # K % 16 == 0: no byte is cut by K
            c = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte columns
            c_mask = ((2 * c < K) | EVEN_K)[:, None] & n_ok[None, :]  # [BK / 2, BN]
            byte = tl.load(q_cols + c[:, None] * stride_qk, mask=c_mask, other=0)
            gs = kb * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)  # [BK / G] groups
            s_ptrs = s_cols + gs[:, None] * stride_sk  # [BK / G, BN]: each scale once
            s_mask = ((gs * GROUP < K) | EVEN_K)[:, None] & n_ok[None, :]
            if NATIVE_FP8:  # float8_e4m3fn, the hardware's conversion
                s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
            else:  # its bytes (the interpreter's fp8 loads lose the NaN codes)
                s = _e4m3_bits_to_f32(tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32))
            acc = _nvfp4_step(acc, a, byte, s, BLOCK_M, BLOCK_K, DOT_PRECISION, DECODE)
        else:
            g = kb * GROUPS_PER_STEP + rg  # [BK / G] scale columns of this step
            s_mask = ((g * GROUP < K) | EVEN_K)[:, None] & n_ok[None, :]  # [BK / G, BN]
            c = kb * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # [BK / 8] word columns
            word = tl.load(q_cols + c[:, None] * stride_qk,
                           mask=((8 * c < K) | EVEN_K)[:, None] & n_ok[None, :],
                           other=0)  # [BK / 8, BN]
            nib = (word[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 15  # [BK/8, 8, BN]
            nib = tl.reshape(nib, (BLOCK_K, BLOCK_N))  # [BK, BN]: bits 4 (k % 8) of word k // 8
            # NOTE: the last word's nibbles past K are padding (any value): finite here, they
            # meet x's masked zeros
            w = (nib - 8).to(tl.float32)  # [BK, BN]
            s = tl.load(s_cols + g[:, None] * stride_sk, mask=s_mask,
                        other=0.0).to(tl.float32)  # [BK / G, BN]
            s = _spread_groups(s, GROUP)  # [BK, BN]: each scale over its group's rows
            acc = tl.dot(a, (w * s).to(a.dtype), acc, input_precision=DOT_PRECISION)
    if NVFP4:
        g = tl.load(g_ptr + rn * stride_g, mask=n_ok, other=0.0) * _unscale(DECODE)  # [BN]
        acc *= g[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = (out_ptr + pid_s.to(tl.int64) * split_stride + rm.to(tl.int64)[:, None] * stride_om
           + rn.to(tl.int64)[None, :] * stride_on)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
