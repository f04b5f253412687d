"""MoE experts over quantized expert weights on Triton: `moe_quant_triton`, the same contract as
`quant.ref.moe_quant_ref`, and its kernel `_fused_moe_quant_kernel`, templated by FORMAT.

The data flow is `moe_triton`'s (fused_triton.py), for T tokens, k experts each, M = T * k pairs
(pair p = t * k + i), weights in quant/packed.py's layouts, logical w13 [E, 2I, H], w2 [E, H, I]:

    topk_ids --moe_align_block_size_triton--> sorted_token_ids [P], expert_ids [P / BLOCK_M]
    (fp8: x [T, H] --quantize_activations--> x_q e4m3 [T, H], s_x fp32 [T, ceil(H / 128)])
    launch 1 (gated), program (block b, N-tile n), e = expert_ids[b]:
        gate, up = rows @ w13[e, n-tile].T, rows @ w13[e, I + n-tile].T    rows = x[pair // k]
        act[pair, n-tile] = silu(gate) * up                  act [M, I] in x's dtype
    (fp8: act --quantize_activations--> act_q [M, I], s_act [M, ceil(I / 128)]; on CUDA,
     where act_quant.py's switch and rule say, in launch 1's epilogue instead)
    launch 2: out[pair] = topk_weights[pair] * act[pair] @ w2[e, n-tile].T   out [T, k, H]
    combine "sum": out.sum(1) (reduce=False returns the parts); rows of -1 pairs zeroed by
    fused_triton's `_zero_nonlocal_rows` (neither launch computes them)

B tiles ([BLOCK_K, BLOCK_N] of w[e]^T, read in place through the strides) come in their packed
dtype and are dequantized in registers, per FORMAT:

    nvfp4  uint8 bytes (two e2m1 nibbles, element 2j low) and the step's [BK / 16, BN] e4m3
           group scales, each loaded once and spread over its group's 8 bytes in registers
           (on CUDA loaded as float8, on CPU as bytes decoded by bit arithmetic; a per-byte
           gather instead left synchronous loads in the K loop, and from 4 bytes a thread
           the compact tile is a cp.async of the pipeline: Triton 3.6's sm90 SASS, 16 x 64 x
           128 gated tile, 754 -> 646 loop instructions, 8 -> 0 LDGs, 16 -> 0 STS, one
           barrier a step less): linear/nvfp4_tile.py's step dots x's even and odd
           columns with the low and high nibbles' [BK / 2, BN] tiles (BLOCK_K >= 32), each
           e2m1 * scale, exact in x's dtype; global_scale[e, n] multiplies the fp32
           accumulator's column n before the epilogue (gate and up rows their own)
    int4   int32 words of 8 nibbles (q + 8): w = (nibble - 8) * scale[n, k // group]; from
           BLOCK_K 128 by linear/int4_tile.py's nibble planes (x's eight column classes each
           dotted with one nibble of every word: no reshape of the weight tile; in bf16 the
           decode in inline PTX), below it the [BK / 8, 8, BN] nibbles reshaped to [BK, BN]
    fp8    e4m3 as loaded; A is e4m3 too, BLOCK_K = 128 (one scale column a step):
           acc += dot(a_q, b_q) * s_a[row, kb] * s_b[e, n // scale_rows, kb]   (fp32)
           where a tile's rows lie in one block of scale_rows (128-row blocks, BLOCK_N
           dividing 128, N a multiple of 128: ONE_SCALE_ROW) s_b is one scalar load a step,
           not BLOCK_N (kernel_sass.py: 34 -> 4 LDGs a step of the 64 x 128 gated tile)

For nvfp4 / int4 the dequantized tile is in x's dtype and multiplied by tl.dot in fp32 (fp32:
input_precision "ieee"). int4's tile is the same weights, bit for bit, as
`packed.dequantize(...)` in x's dtype; nvfp4's is dequantize / global_scale, exact, the global
scale then applied once in fp32 (the reference folds it into each weight, one rounding more),
so the op differs from the reference by summation order and that one rounding.

The nvfp4 tile's forms tried and removed (transposed, in Gluon, register-A), with their figures,
and what the tile's sm90 loop does per K step: docs/moe-quant-kernels.md.

Tiles: a `config` of tile_configs.CONFIG_KEYS for both launches (a "down" entry: the down
launch's own, BLOCK_M shared; the SUB_M option: a block of few real rows computes a half or a
quarter tile), else the lookup of
quant/configs.py (a tuned file of quant/tune.py, nearest token count; or, untuned or with
tiles "default", `default_quant_config`: BLOCK_M 16/32/64 by the pairs per expert); BLOCK_K a
multiple of the group (nvfp4, int4) or exactly 128 (fp8). No host sync: the launches' shapes
depend on shapes only, so the op can be captured in a CUDA graph. triton is imported on first
use (`_kernel`).

NOTE (CPU, Triton's interpreter): its fp32 -> e4m3 cast is wrong (fp8_block_triton.py), so on
CPU the activations are quantized with the torch reference (on CUDA with
`quantize_activations_triton`); its bf16 loads are wrong, so bf16 x (or int4 bf16 scales) are
refused on CPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from moeserve.kernels.linear import int4_tile, nvfp4_tile
from moeserve.kernels.linear.fp8_block_triton import quantize_activations_triton
from moeserve.kernels.moe.align import moe_align_block_size_triton
from moeserve.kernels.moe.fused_triton import _zero_nonlocal_rows
from moeserve.kernels.moe.quant import act_quant, fp8_gluon, micro_tiles
from moeserve.kernels.moe.quant.checks import check_inputs
from moeserve.kernels.moe.quant.configs import check_quant_config, get_quant_config
from moeserve.kernels.moe.tile_configs import (
    check_tile_source,
    down_tiles,
    sub_heights,
    tile_device_name,
    tile_tokens,
)
from moeserve.quant.fp8_block import _MIN_SCALE, E4M3, E4M3_MAX, quantize_activations
from moeserve.quant.packed import FP8_GROUP

FORMAT_IDS = {"fp8": 0, "nvfp4": 1, "int4": 2}  # the kernel's FORMAT constexpr
# fp8's activation and weight scales loaded a K step ahead (an experiment switch, off until
# the H200 measures it faster: benchmarks/quant/kernels_quant.py --fp8-prefetch off on). The same
# values and ops either way, so the same bits (tests compare them). Triton 3.6's sm90 SASS,
# 16 x 64 x 128 gated tile: every in-loop scale load one step ahead of its use, for 239 -> 255
# loop instructions.
prefetch_scales = False
# A cap on the registers a thread (Triton's maxnreg launch option), None: ptxas's choice. An
# experiment switch (kernels_quant.py --maxnreg): at 128 registers the 4-warp 16 x 64 x 128
# W4A16 tile holds 4 programs an SM; 96 fits 5 (20 bytes spilled), 80 fits 6 (72). Same bits,
# but slower on an H100 (gpu_2d81e17/call5: 80 registers 1.87 against 1.55 ms, 96 at 1,024
# tokens 3.08 against 0.47): off.
max_registers: int | None = None
tl: Any = None  # triton.language, bound by _kernel() on first use (lazy import)
_quant_store: Any = None  # act_quant.quant_store, jitted by _kernel()


def moe_quant_triton(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, config: dict | None = None,
                     tiles: str = "tuned", reduce: bool = True,
                     routed_experts: int | None = None) -> torch.Tensor:
    """Routed experts over quantized weights in two launches (see the module docstring).

    Args:
        x: [T, H] fp32 / fp16 / bf16 (bf16 on CUDA only), last dim contiguous.
        w13: quantized (QuantWeight / QuantView: format, qweight, scale, global_scale, group,
            scale_rows, shape), logical [E, 2I, H], gate rows then up rows.
        w2: quantized, logical [E, H, I], the same format.
        topk_weights: [T, k] float32, contiguous.
        topk_ids: [T, k] integer expert ids in [0, E) (not checked: that would sync), or -1:
            not on this rank (never computed; its part row is 0).
        config: tiles, the keys of tile_configs.CONFIG_KEYS (both launches; "down": the down
            launch's own, BLOCK_M shared; SUB_M the one option);
            default: `quant.configs.get_quant_config` with `tiles`.
        tiles: where a looked-up config comes from (tile_configs.TILE_SOURCES): "tuned" (the
            nearest token count of a tuned file for this device, format and shape, else the
            default) or "default" (`default_quant_config`, no file read).
        reduce: False returns the k weighted parts [T, k, H] (summing over dim 1 to the result).
    Returns:
        [T, H] in x's dtype ([T, k, H] with reduce False).
    """
    check_tile_source(tiles)
    fmt, (group13, rows13), (group2, rows2) = check_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w2.shape[-1], topk_ids.shape[1]
    if num_tokens == 0:
        return x.new_empty(0, hidden) if reduce else x.new_empty(0, top_k, hidden)
    if config is None:  # host-side lookups only (cached files): no sync, graph-capturable
        config = get_quant_config(fmt, num_experts, hidden, inter, top_k, max(group13, group2),
                                  x.dtype, tile_tokens(num_tokens, num_experts, routed_experts),
                                  tile_device_name(x.device), tiles=tiles,
                                  micro=micro_tiles.is_micro(w13)).config
    check_quant_config(config, fmt, (group13, group2))
    if fmt == "fp8" and (block_m := fp8_gluon.block_m(config)) != config["BLOCK_M"]:
        config = {**config, "BLOCK_M": block_m}  # the switch's experiment
    # the grid covers every block; those past the used ones (expert -1) return at once, so
    # num_tokens_post_padded is not read
    sorted_ids, expert_ids, _ = moe_align_block_size_triton(topk_ids, num_experts,
                                                            config["BLOCK_M"])
    num_pairs = num_tokens * top_k

    a, a_scale = _activations(x, fmt)  # fp8: ([T, H] e4m3, [T, H / 128] fp32), else (x, None)
    if _fuses_act_quant(fmt, a, a_scale, w13, rows13, config):
        # [M, I] e4m3 and [M, I / 128] fp32 straight from launch 1 (rows of -1 pairs unwritten,
        # never read)
        act = torch.empty(num_pairs, inter, dtype=E4M3, device=x.device)
        act_scale = torch.empty(num_pairs, inter // FP8_GROUP, dtype=torch.float32,
                                device=x.device)
        _launch(fmt, a, a_scale, w13, group13, rows13, act, topk_weights, sorted_ids,
                expert_ids, num_pairs, config, a_row_div=top_k, gated=True,
                c_scale=act_scale, act_round=act_quant.ACT_ROUND[x.dtype])
        a, a_scale = act, act_scale
    else:
        act = x.new_empty(num_pairs, inter)  # [M, I], row = pair
        _launch(fmt, a, a_scale, w13, group13, rows13, act, topk_weights, sorted_ids,
                expert_ids, num_pairs, config, a_row_div=top_k, gated=True)
        a, a_scale = _activations(act, fmt)  # rows of -1 pairs unwritten: quantized, never read
    out = x.new_empty(num_tokens, top_k, hidden)  # [T, k, H], row pair = t * k + i
    _zero_nonlocal_rows(out.view(num_pairs, hidden), topk_ids)  # rows no launch writes
    _launch(fmt, a, a_scale, w2, group2, rows2, out.view(num_pairs, hidden), topk_weights,
            sorted_ids, expert_ids, num_pairs, down_tiles(config), a_row_div=1, gated=False)
    if not reduce:
        return out
    return out.view(num_tokens, hidden) if top_k == 1 else out.sum(dim=1)


def _activations(a: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The A operand: a itself (W4A16), or fp8's run-time quantization of it (W8A8)."""
    if fmt != "fp8":
        return a, None
    if a.device.type == "cpu":  # the interpreter's e4m3 cast is wrong (module docstring)
        return quantize_activations(a)
    return quantize_activations_triton(a)


def _gluon_takes(fmt: str, a: torch.Tensor, a_scale: torch.Tensor | None, w: Any,
                 scale_rows: int, config: dict[str, int], gated: bool) -> bool:
    """Whether fp8_gluon's kernel runs this launch (its switch: `fp8_gluon.takes`)."""
    return (fmt == "fp8" and fp8_gluon.takes(gated) and config["BLOCK_M"] in (64, 128)
            and fp8_gluon.supports(a, a_scale, w, scale_rows, gated))


def _fuses_act_quant(fmt: str, a: torch.Tensor, a_scale: torch.Tensor | None, w13: Any,
                     scale_rows: int, config: dict[str, int]) -> bool:
    """Whether launch 1 quantizes act in its epilogue: act_quant.fuses, this module's kernel
    running the launch (not fp8_gluon's)."""
    return (act_quant.fuses(fmt, a.device, w13.shape[1] // 2, config)
            and not _gluon_takes(fmt, a, a_scale, w13, scale_rows, config, True))


def _launch(fmt: str, a: torch.Tensor, a_scale: torch.Tensor | None, w: Any, group: int,
            scale_rows: int, c: torch.Tensor, topk_weights: torch.Tensor,
            sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int,
            config: dict[str, int], *, a_row_div: int, gated: bool,
            c_scale: torch.Tensor | None = None, act_round: int = 0) -> None:
    """One grouped GEMM c[rows] = a[rows] @ dequant(w[e]).T over expert-sorted row blocks.

    gated: w is w13 (N = I, silu(gate) * up in the epilogue), a_row_div = k (A's row of pair p
    is token p // k); else w is w2 (N = H, rows scaled by their routing weight). c_scale
    (fp8, gated, `_fuses_act_quant`): c is e4m3 and c_scale [rows, N / 128] fp32, act
    quantized in the epilogue after its rounding by act_round (act_quant.ACT_ROUND).
    """
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    if _gluon_takes(fmt, a, a_scale, w, scale_rows, config, gated):
        fp8_gluon.launch(a, a_scale, w, c, topk_weights, sorted_ids, expert_ids, num_pairs,
                         config["BLOCK_M"], a_row_div=a_row_div, gated=gated)
        return
    qweight = w.qweight  # [E, N, K / pack]: e4m3, uint8 or int32
    native_fp8 = a.device.type == "cuda"  # nvfp4's scales loaded as float8 (else as bytes)
    scale = w.scale.view(torch.uint8) if fmt == "nvfp4" and not native_fp8 else w.scale
    glob = w.global_scale if fmt == "nvfp4" else scale  # unused unless nvfp4
    a_scale = a_scale if a_scale is not None else topk_weights  # unused unless fp8
    num_blocks = expert_ids.shape[0]
    grid = (num_blocks * -(-n_out // config["BLOCK_N"]),)  # blocks past the used ones return
    quant_out = c_scale is not None
    c_scale = c_scale if quant_out else topk_weights  # unused unless quant_out
    _kernel()[grid](
        a, a_scale, qweight, scale, glob, c, c_scale, topk_weights, sorted_ids, expert_ids,
        num_pairs, num_blocks, n_out, k_dim,
        a.stride(0), a_scale.stride(0),  # A [rows, K], its fp8 scales [rows, K / 128]
        qweight.stride(0), qweight.stride(1), qweight.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        glob.stride(0), glob.stride(1),  # [E, N] (nvfp4)
        c.stride(0), c_scale.stride(0),  # C [M, N] (and its scales [M, N / 128])
        FORMAT=FORMAT_IDS[fmt], GROUP=group, SCALE_ROWS=scale_rows,
        ONE_SCALE_ROW=fmt == "fp8" and scale_rows % config["BLOCK_N"] == 0
        and n_out % scale_rows == 0, A_ROW_DIV=a_row_div,
        GATED=gated, EVEN_K=k_dim % config["BLOCK_K"] == 0,
        DOT_PRECISION="ieee" if c.dtype == torch.float32 else "tf32", NATIVE_FP8=native_fp8,
        DECODE=(nvfp4_tile.decode_id(a.dtype, a.device) if fmt == "nvfp4" else
                int4_tile.decode_id(config["BLOCK_K"], a.dtype, w.scale.dtype, a.device)
                if fmt == "int4" else 0),
        PREFETCH=fmt == "fp8" and prefetch_scales, QUANT_OUT=quant_out, ACT_ROUND=act_round,
        FP8_MAX=E4M3_MAX, MIN_SCALE=_MIN_SCALE,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"], MICRO=micro_tiles.micro_arg(fmt, w, qweight),
        **sub_heights(config),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **({"maxnreg": max_registers} if max_registers and a.device.type == "cuda" else {}))


@functools.cache
def _kernel() -> Any:
    """Build `_fused_moe_quant_kernel` on first use (the only place triton is imported).

    As in fused_triton.py, only builtins of triton.language are called (its @jit helpers are
    bound at import and would not be interpreted under a later TRITON_INTERPRET=1), and the
    helpers are jitted here and bound as module globals, where the interpreter finds them.
    """
    global tl, _tile, _b_step, _w_scale, _load_k, _nvfp4_step, _e4m3_bits_to_f32, _spread_groups
    global _unscale, _int4_planes_step, _b_offsets, _sub_rows, _quant_store
    import triton
    import triton.language as tl

    from moeserve.kernels.moe import fused_triton as bf16_moe

    bf16_moe._kernel()  # binds its jitted helpers, _sub_rows among them
    _sub_rows = bf16_moe._sub_rows

    _tile, _b_step, _w_scale, _load_k = (triton.jit(f) for f in (_tile, _b_step, _w_scale,
                                                                  _load_k))
    act_quant.tl = tl  # the name its helper's body resolves
    _quant_store = triton.jit(act_quant.quant_store)
    _b_offsets = micro_tiles.jitted().packed_offsets
    tiles = nvfp4_tile.jitted()
    _nvfp4_step, _e4m3_bits_to_f32 = tiles.nvfp4_step, tiles.e4m3_bits_to_f32
    _spread_groups, _unscale = tiles.spread_groups, tiles.unscale
    _int4_planes_step = int4_tile.jitted().int4_planes_step

    # the step-varying sizes exempt from Triton's value specialization. NOTE: not the row
    # strides (a model's constants): specialized, their divisibility by 16 lets the A loads
    # vectorize and be pipelined (cp.async); exempt, every A load was a scalar LDG (Triton
    # 3.6's sm90 compile of the nvfp4 decode tile: 1,232 SASS instructions against 1,088, the
    # fp8 64 x 128 tile 2,512 against 1,608)
    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _fused_moe_quant_kernel(
            a_ptr, as_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr, cs_ptr, weights_ptr, sorted_ids_ptr,
            expert_ids_ptr, num_pairs, num_blocks, N, K, stride_am, stride_asm,
            stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sk,
            stride_ge, stride_gn, stride_cm, stride_csm,
            FORMAT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr,
            ONE_SCALE_ROW: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
            EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr,
            DECODE: tl.constexpr, PREFETCH: tl.constexpr, QUANT_OUT: tl.constexpr,
            ACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
            BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            MICRO: tl.constexpr = 0, HALF_M: tl.constexpr = 0, QUARTER_M: tl.constexpr = 0):
        # (row block, N-tile): GROUP_M row blocks side by side per N-tile (B tiles shared in L2)
        pid = tl.program_id(0)
        num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
        group_size = GROUP_M * num_pid_n
        first_m = (pid // group_size) * GROUP_M
        group_m = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % group_size) % group_m
        pid_n = (pid % group_size) // group_m
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert >= 0:  # else past the used blocks
            which = 0  # the whole block's tile; with SUB_M (HALF_M > 0) by its real rows
            if HALF_M > 0:  # they come first: the align fills an expert's run, pads its end
                ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
                real = tl.sum((ids < num_pairs).to(tl.int32), axis=0)
                which = _sub_rows(real, BLOCK_M, HALF_M, QUARTER_M)  # 0, 1 or 2
            # the whole block's tile, its half, its quarter: one call site, unrolled (r and
            # so the height are constexprs), each height compiled only where it exists
            for r in tl.static_range(3):
                if r == 0 or (r == 1 and HALF_M > 0) or (r == 2 and QUARTER_M > 0):
                    if which == r:
                        _tile(a_ptr, as_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr, cs_ptr, weights_ptr,
                              sorted_ids_ptr, pid_m, pid_n, expert, num_pairs, N, K,
                              stride_am, stride_asm, stride_be, stride_bn, stride_bk,
                              stride_se, stride_sn, stride_sk, stride_ge, stride_gn, stride_cm,
                              stride_csm, FORMAT, GROUP, SCALE_ROWS, ONE_SCALE_ROW, A_ROW_DIV,
                              GATED, EVEN_K, DOT_PRECISION, NATIVE_FP8, DECODE, PREFETCH,
                              QUANT_OUT, ACT_ROUND, FP8_MAX, MIN_SCALE, BLOCK_M, BLOCK_N,
                              BLOCK_K, MICRO,
                              BLOCK_M >> r)

    return _fused_moe_quant_kernel


# ---- Triton helpers (jitted by _kernel; module globals, as the interpreter resolves names) ----

def _tile(a_ptr, as_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr, cs_ptr, weights_ptr, sorted_ids_ptr,
          pid_m, pid_n, expert, num_pairs, N, K, stride_am, stride_asm,
          stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sk,
          stride_ge, stride_gn, stride_cm, stride_csm,
          FORMAT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr,
          ONE_SCALE_ROW: tl.constexpr, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
          EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr,
          DECODE: tl.constexpr, PREFETCH: tl.constexpr, QUANT_OUT: tl.constexpr,
          ACT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
          BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MICRO: tl.constexpr,
          ROWS: tl.constexpr):
    """One [ROWS, BLOCK_N] output tile: the first ROWS (BLOCK_M, or a half or quarter of it
    with SUB_M) rows of row block pid_m (expert `expert`, int64); MICRO: the packed columns of a
    micro-tile's row (micro_tiles.py), 0 for the row layout."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, ROWS))  # [ROWS]
    row_ok = pairs < num_pairs  # padding holds the sentinel num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns
    rows = offs_n % N  # [BN] weight rows: in bounds unmasked, the store masks the tail
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am  # [BM, 1]; A's last dim is contiguous
    b_base = b_ptr + expert * stride_be
    s_base = bs_ptr + expert * stride_se
    acc = tl.full((ROWS, BLOCK_N), 0.0, dtype=tl.float32)
    acc_up = tl.full((ROWS, BLOCK_N), 0.0, dtype=tl.float32)  # the up rows' (gated)
    # fp8: the rows' scales of a 128-group ([BM]) and the weights' (gate and up rows their
    # own); with PREFETCH each loaded a step ahead (a load that feeds no dot is not in
    # Triton's pipeline: loaded in the step that uses it, its latency is the step's)
    s_rows = as_ptr + a_rows * stride_asm
    s_a = tl.full((ROWS,), 0.0, dtype=tl.float32)
    s_g = 0.0
    s_u = 0.0
    if FORMAT == 0:
        s_a = tl.load(s_rows, mask=row_ok, other=0.0)
        s_g = _w_scale(s_base, rows, pid_n * BLOCK_N, 0, stride_sn, stride_sk, SCALE_ROWS,
                       ONE_SCALE_ROW)
        if GATED:
            s_u = _w_scale(s_base, rows + N, pid_n * BLOCK_N + N, 0, stride_sn, stride_sk,
                           SCALE_ROWS, ONE_SCALE_ROW)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BK]
        k_ok = kk < K  # unused when EVEN_K
        s_a_next, s_g_next, s_u_next = s_a, s_g, s_u
        if FORMAT == 0:
            kb = k0 // BLOCK_K
            if PREFETCH:  # the next group's; after the last, the last again (unused)
                kb = kb + 1 - ((kb + 1) * BLOCK_K >= K)
            s_a_next = tl.load(s_rows + kb, mask=row_ok, other=0.0)
            s_g_next = _w_scale(s_base, rows, pid_n * BLOCK_N, kb, stride_sn, stride_sk,
                                SCALE_ROWS, ONE_SCALE_ROW)
            if GATED:
                s_u_next = _w_scale(s_base, rows + N, pid_n * BLOCK_N + N, kb, stride_sn,
                                    stride_sk, SCALE_ROWS, ONE_SCALE_ROW)
            if not PREFETCH:  # this step's own
                s_a, s_g, s_u = s_a_next, s_g_next, s_u_next
        if EVEN_K:
            a = tl.load(a_base + kk[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BK]
        else:
            a = tl.load(a_base + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _b_step(acc, a, s_a, s_g, b_base, s_base, rows, kk, k_ok, k0, K, stride_bn,
                      stride_bk, stride_sn, stride_sk, FORMAT, GROUP, ONE_SCALE_ROW, EVEN_K,
                      DOT_PRECISION, NATIVE_FP8, DECODE, ROWS, BLOCK_N, BLOCK_K, MICRO)
        if GATED:  # the up rows N + n: their own scales
            acc_up = _b_step(acc_up, a, s_a, s_u, b_base, s_base, rows + N, kk, k_ok, k0, K,
                             stride_bn, stride_bk, stride_sn, stride_sk, FORMAT, GROUP,
                             ONE_SCALE_ROW, EVEN_K, DOT_PRECISION, NATIVE_FP8, DECODE, ROWS,
                             BLOCK_N, BLOCK_K, MICRO)
        s_a, s_g, s_u = s_a_next, s_g_next, s_u_next
    if FORMAT == 1:  # nvfp4's global scales, per weight row (gate and up rows their own)
        g_rows = bg_ptr + expert * stride_ge + rows.to(tl.int64) * stride_gn  # [BN]
        acc = acc * (tl.load(g_rows) * _unscale(DECODE))[None, :]
        if GATED:
            acc_up = acc_up * (tl.load(g_rows + N * stride_gn) * _unscale(DECODE))[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    else:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    if QUANT_OUT:  # fp8 act quantized here (act_quant.py): e4m3 bytes and a scale a group
        _quant_store(acc, c_ptrs, cs_ptr + pairs.to(tl.int64) * stride_csm, row_ok, pid_n, N,
                     ACT_ROUND, FP8_MAX, MIN_SCALE, ROWS, BLOCK_N)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_n < N)[None, :])


def _w_scale(s_base, rows, row0, kb, stride_sn, stride_sk, SCALE_ROWS: tl.constexpr,
             ONE_SCALE_ROW: tl.constexpr):
    """fp8: the weight scales of 128-group kb for rows `rows` (the first: row0): one scalar
    where the tile's rows lie in one block of SCALE_ROWS (ONE_SCALE_ROW), else [BN]."""
    if ONE_SCALE_ROW:  # one return: Triton types every return alike, constexpr or not
        s = tl.load(s_base + (row0 // SCALE_ROWS) * stride_sn + kb * stride_sk)
    else:
        s = tl.load(s_base + (rows.to(tl.int64) // SCALE_ROWS) * stride_sn + kb * stride_sk)
    return s


def _b_step(acc, a, s_a, s_b, b_base, s_base, rows, kk, k_ok, k0, K, stride_bn, stride_bk,
            stride_sn, stride_sk, FORMAT: tl.constexpr, GROUP: tl.constexpr,
            ONE_SCALE_ROW: tl.constexpr, EVEN_K: tl.constexpr,
            DOT_PRECISION: tl.constexpr, NATIVE_FP8: tl.constexpr, DECODE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            MICRO: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ the [BK, BN] tile of weight rows `rows` at columns kk,
    dequantized per FORMAT (0 fp8, 1 nvfp4, 2 int4; the module docstring); fp8's scales
    s_a [BM] and s_b (`_w_scale`) are the caller's."""
    rows = rows.to(tl.int64)
    if FORMAT == 0:  # e4m3 x e4m3 in fp32, times s_a[row] and s_b[row // SCALE_ROWS]
        b = _load_k(b_base + rows[None, :] * stride_bn + kk[:, None] * stride_bk, k_ok, EVEN_K)
        # the two scales multiplied first: with one weight scale a step the product is [BM]
        # and each accumulator takes one FFMA (sm90, a 128 x 128 gated tile: its loop's 128
        # FMUL + 128 FFMA a thread were the dot's product times s_a, then times s_b plus acc)
        if ONE_SCALE_ROW:  # the tile's rows lie in one block of SCALE_ROWS: one scale a step
            acc += tl.dot(a, b) * (s_a * s_b)[:, None]  # the per-row path's bits
        else:  # a scale a row (BLOCK_N of them a step)
            acc += tl.dot(a, b) * (s_a[:, None] * s_b[None, :])
    elif FORMAT == 1:  # the bytes and, per byte, its group's scale: nvfp4_tile's step
        c = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte columns
        c_ok = c * 2 < K  # past K: 0 (x's columns there are 0)
        byte = _load_k(b_base + _b_offsets(rows[None, :], c[:, None], stride_bn, stride_bk,
                                           MICRO), c_ok, EVEN_K)  # [BK / 2, BN] uint8
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # [BK / G] group columns
        s_ptrs = s_base + rows[None, :] * stride_sn + g[:, None] * stride_sk  # [BK / G, BN]
        if NATIVE_FP8:  # float8_e4m3fn, the hardware's conversion
            scale = _load_k(s_ptrs, g * GROUP < K, EVEN_K).to(tl.float32)
        else:  # its bytes (the interpreter's fp8 loads lose the NaN codes)
            scale = _e4m3_bits_to_f32(_load_k(s_ptrs, g * GROUP < K, EVEN_K).to(tl.int32))
        acc = _nvfp4_step(acc, a, byte, scale, BLOCK_M, BLOCK_K, DOT_PRECISION, DECODE)
    else:
        # each packed word and each group scale loaded once: [BK / 8, BN] and [BK / G, BN],
        # spread to the [BK, BN] tile in registers (8 nibbles a word)
        kp = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK / 8] packed columns
        kg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # [BK / G] scale columns
        kp_ok, kg_ok = kp * 8 < K, kg * GROUP < K  # past K: 0 (x's columns there are 0)
        packed = _load_k(b_base + _b_offsets(rows[None, :], kp[:, None], stride_bn, stride_bk,
                                             MICRO), kp_ok, EVEN_K).to(tl.int32)  # [BK / 8, BN]
        step = _load_k(s_base + rows[None, :] * stride_sn + kg[:, None] * stride_sk, kg_ok,
                       EVEN_K).to(tl.float32)  # [BK / G, BN]
        if DECODE >= 1:  # int4_tile's nibble planes: each scale over its group's words
            acc = _int4_planes_step(acc, a, packed, _spread_groups(step, GROUP // 8),
                                    BLOCK_M, BLOCK_K, DOT_PRECISION, DECODE)
        else:  # "reshape": every word's 8 nibbles into the [BK, BN] tile (8 j + i: nibble i)
            nib = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            nib = tl.reshape(nib, (BLOCK_K, BLOCK_N))
            step = _spread_groups(step, GROUP)  # [BK, BN]: each scale over its group's rows
            w_val = (nib - 8).to(tl.float32)  # int32 words of 8 nibbles, stored as q + 8
            acc = tl.dot(a, (w_val * step).to(a.dtype), acc, input_precision=DOT_PRECISION)
    return acc


def _load_k(ptrs, k_ok, EVEN_K: tl.constexpr):
    """A [BK, BN] tile; rows past K (not EVEN_K) load 0."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_ok[:, None], other=0.0)
