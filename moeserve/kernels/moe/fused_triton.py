"""MoE experts as a Triton fused grouped GEMM: gather, both expert GEMMs, SiLU-mul and weighting.

Owns `moe_triton` (the "triton" MoE backend, same contract as `moe_loop_ref`) and the kernel
`_fused_moe_kernel`, launched twice. Data flow, for T tokens, k experts each, M = T * k pairs
(pair p = t * k + i), E experts, weights w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]:

    topk_ids --moe_align_block_size(_triton)--> sorted_token_ids [P], expert_ids [P / BLOCK_M]
    launch 1, program (block b, N-tile n), e = expert_ids[b]:
        rows = x[sorted_token_ids[b-tile] // k]         gathered in the loads, no x_sorted copy
        gate = rows @ w13[e, n-tile].T,  up = rows @ w13[e, I + n-tile].T   (fp32 accumulators)
        act[pair, n-tile] = silu(gate) * up             act: [M, I], in (token, slot) order
    launch 2, program (block b, N-tile n):
        y = act[sorted pairs] @ w2[e, n-tile].T * topk_weights[pair]   (weight in the epilogue)
        combine "sum":    y -> out[pair] of [T, k, H] in x's dtype, then one .sum(1) over k
                          (k == 1: out is already [T, H], no reduction at all); the rows of
                          pairs of id -1 get zeros from `_zero_rows_kernel`
        combine "atomic": tl.atomic_add(y) into a zeroed fp32 [T, H], then one cast to x's dtype

So the gate_up tensor [M, 2I] never exists, the activation is fused into the first GEMM's
epilogue, and the routing weight into the second's. "sum" (the default) is deterministic: the
same inputs give the same bits, eager or in a CUDA graph. "atomic" writes T * H fp32 instead of
M * H, but the order of the k additions varies from run to run.

Expert parallelism: a topk_ids entry of -1 means the pair's expert is on another rank. The align
gives such a pair no row, so neither launch computes it (act's row of it stays unwritten and is
never read); "atomic" adds nothing for it, and "sum" zeroes its out row with one small launch
(`_zero_rows_kernel`: it reads the M ids and stores only the rows of -1 pairs, so without them
it writes nothing), so the pair's part row is exactly 0.

Tiles: one config (`moe_configs`) for both launches, BLOCK_M shared (it is the align's block
size); its optional "down" entry gives launch 2 its own BLOCK_N, BLOCK_K, GROUP_M, num_warps and
num_stages (the two GEMMs differ: N = I with two accumulators vs N = H with one, and a tune may
find different best tiles for each). Without "down" launch 2 uses the top-level tiles. Two
launch options ride in the config too (0 when absent; the tuner tries them):

- "ONE_DOT": 1 (gated launch): the program reads one [BLOCK_K, 2 * BLOCK_N] tile whose column
  2j is gate row j and column 2j + 1 up row j (a gather of w13's rows in place: w13 keeps its
  layout) and does one dot into one [BLOCK_M, 2 * BLOCK_N] accumulator, split in the epilogue:
  one MMA of twice the width per K step instead of two, A read from shared memory once.
- "PERSISTENT": n (either launch): n programs per SM instead of one per tile; a program walks
  the used tiles (blocks below num_tokens_post_padded, read on the device) with a stride of the
  program count, in one loop that Triton flattens with the K loop (`tl.range(...,
  flatten=True)`), so the next tile's loads overlap this tile's epilogue instead of every tile
  paying its pipeline's fill. The same tiles and sums: the same bits as one program per tile.
- "SUB_M": 1 (either launch; not with PERSISTENT): a program counts the real rows of its row
  block (they come first: the align fills an expert's run in order and pads its end) and, when
  they fit a quarter or a half of BLOCK_M (>= 16), computes a tile of that height instead. An
  expert's last block is mostly padding when few rows reach each expert: at 2,048 tokens of
  qwen3-30b-a3b (128 per expert on average) BLOCK_M 128 computes 1.48x the real rows, at 1,024
  tokens 2x; quarter tiles bring that to about 1.12x and 1.24x.

Weights are read in place through their strides as [BLOCK_K, BLOCK_N] tiles of w[e] (no copy or
transpose). Padded rows (sentinel pair M) load zeros and are never stored; blocks past the used
ones (expert id -1) return at once, and experts with no pairs have no blocks. Nothing reads a
device value on the host, so the op can be captured in a CUDA graph. fp32 uses
`input_precision="ieee"` (no TF32), so it matches the torch reference tightly.

On sm90 under `gluon_ws.mode` (an experiment, "off"), launches of 128-row blocks run
kernels/moe/gluon_ws.py's warp-specialized, persistent Gluon kernel instead (its 128 x 256
tiles for many rows an expert; `_launch`).

triton is imported lazily (`_kernel()`), so importing this module works without it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from moeserve.kernels.moe import gluon_ws
from moeserve.kernels.moe.align import moe_align_block_size, moe_align_block_size_triton
from moeserve.kernels.moe.tile_configs import (
    check_config,
    check_tile_source,
    down_tiles,
    get_moe_config,
    launch_options,
    sub_heights,
    tile_device_name,
    tile_tokens,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_COMBINES = ("sum", "atomic")
_ALIGNS = {"triton": moe_align_block_size_triton, "torch": moe_align_block_size}
_ZERO_ROWS, _ZERO_COLS = 16, 128  # the tile of one `_zero_rows_kernel` program's stores
tl: Any = None  # triton.language, bound by _kernel() on first use (lazy import)


def moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
               config: dict | None = None, tiles: str = "tuned", combine: str = "sum",
               align: str = "triton", reduce: bool = True,
               routed_experts: int | None = None) -> torch.Tensor:
    """Routed experts through two launches of `_fused_moe_kernel` (see the module docstring).

    Args:
        x: [T, H], fp32/fp16/bf16, last dim contiguous.
        w13: [E, 2I, H] (gate rows then up rows), x's dtype, last dim contiguous.
        w2: [E, H, I], x's dtype, last dim contiguous.
        topk_weights: [T, k] float32, contiguous.
        topk_ids: [T, k] integer expert ids in [0, E) (not checked: that would sync), or -1:
            not on this rank (never computed; its part row is 0, it adds nothing).
        config: tile config (keys of `moe_configs.CONFIG_KEYS`, optional OPTION_KEYS, plus an
            optional "down" with the down launch's own tiles, `moe_configs.DOWN_KEYS`);
            default: `get_moe_config` with `tiles`.
        tiles: where a looked-up config comes from (`moe_configs.TILE_SOURCES`): "tuned" (a
            tuned file for this device and shape, else the defaults) or "default" (the
            in-code defaults, no file read). Unused when `config` is given.
        routed_experts: the model's routed experts when w13 holds only this rank's E of them
            (expert parallelism): the tiles are looked up at `tile_tokens`' count, the
            density of this rank's pairs. Unused when `config` is given.
        combine: "sum" (deterministic) or "atomic" (fp32 atomics), how the k slots are added.
        align: "triton" (three launches) or "torch" (~25 small kernels): the expert sort.
        reduce: False skips the "sum" pass and returns the k weighted rows [T, k, H] (the next
            norm adds them: `rms_norm_triton` parts); "atomic" then returns [T, 1, H].
    Returns:
        [T, H] in x's dtype ([T, S, H] with reduce False, summing over S to the result).
    """
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    _check_options(x.device, combine, align)
    check_tile_source(tiles)
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w2.shape[-1], topk_ids.shape[1]
    if num_tokens == 0:
        return x.new_empty(0, hidden) if reduce else x.new_empty(0, 1, hidden)
    if config is None:
        config = get_moe_config(num_experts, hidden, inter, top_k, x.dtype,
                                tile_tokens(num_tokens, num_experts, routed_experts),
                                tile_device_name(x.device), tiles=tiles).config
    _check_config(config)
    sorted_ids, expert_ids, post_padded = _ALIGNS[align](topk_ids, num_experts,
                                                         config["BLOCK_M"])
    num_pairs = num_tokens * top_k
    down = down_tiles(config)  # launch 2's tiles: config["down"] or the top-level ones

    act = x.new_empty(num_pairs, inter)  # [M, I], row = pair
    _launch(x, w13, act, topk_weights, sorted_ids, expert_ids, post_padded, num_pairs, config,
            a_row_div=top_k, c_row_div=1, gated=True, atomic=False)
    if combine == "atomic" and top_k > 1:
        out32 = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)  # [T, H]
        _launch(act, w2, out32, topk_weights, sorted_ids, expert_ids, post_padded, num_pairs,
                down, a_row_div=1, c_row_div=top_k, gated=False, atomic=True)
        return out32.to(x.dtype) if reduce else out32.to(x.dtype).unsqueeze(1)
    out = x.new_empty(num_tokens, top_k, hidden)  # [T, k, H], row pair = t * k + i
    _zero_nonlocal_rows(out.view(num_pairs, hidden), topk_ids)  # rows no launch writes
    _launch(act, w2, out.view(num_pairs, hidden), topk_weights, sorted_ids, expert_ids,
            post_padded, num_pairs, down, a_row_div=1, c_row_div=1, gated=False, atomic=False)
    if not reduce:
        return out
    return out.view(num_tokens, hidden) if top_k == 1 else out.sum(dim=1)


def _launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
            sorted_ids: torch.Tensor, expert_ids: torch.Tensor, post_padded: torch.Tensor,
            num_pairs: int, config: dict[str, int], *, a_row_div: int, c_row_div: int,
            gated: bool, atomic: bool) -> None:
    """One grouped GEMM: c[rows] = a[rows] @ w[e].T over expert-sorted row blocks, with the
    top-level tiles and options of `config` (CONFIG_KEYS, OPTION_KEYS; a "down" entry is not
    read here: pass `down_tiles(config)` for the down launch).

    gated: w is w13 ([E, 2I, H]); N = I and the program computes silu(gate) * up (ONE_DOT: in
    one dot of twice the width). Otherwise w is w2 ([E, H, I]); N = H and rows are scaled by
    their routing weight. PERSISTENT n > 0: n programs per SM walk the used tiles. Where
    gluon_ws takes the launch (its mode, 128-row blocks, sm90), its warp-specialized
    kernel runs it instead.
    """
    if gluon_ws.takes(a, w, c, config["BLOCK_M"], gated, atomic, c_row_div, num_pairs):
        gluon_ws.launch(a, w, c, topk_weights, sorted_ids, expert_ids, num_pairs,
                        a_row_div=a_row_div, gated=gated)
        return
    one_dot, persistent, _ = launch_options(config)
    programs = persistent * _num_sms(a.device)  # 0: one program per tile
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    num_blocks = expert_ids.shape[0]
    num_tiles = num_blocks * _cdiv(n_out, config["BLOCK_N"])  # an upper bound: blocks padded
    grid = (min(programs, num_tiles) if programs else num_tiles,)
    _kernel()[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, post_padded,
        num_pairs, num_blocks, grid[0], n_out, k_dim, n_out * w.stride(1),
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, C_ROW_DIV=c_row_div, GATED=gated, MUL_WEIGHT=not gated,
        ATOMIC=atomic, EVEN_K=k_dim % config["BLOCK_K"] == 0, PERSISTENT=programs > 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        B_WIDTH=config["BLOCK_N"] * (2 if gated and one_dot else 1),
        **sub_heights(config), GROUP_M=config["GROUP_M"], num_warps=config["num_warps"],
        num_stages=config["num_stages"])


def _zero_nonlocal_rows(out: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """out[p] = 0 for each pair p whose id is -1 (the down launch never writes those rows):
    one launch of `_zero_rows_kernel`, no host sync; it stores nothing where no id is -1."""
    num_pairs, hidden = out.shape
    _zero_kernel()[(_cdiv(num_pairs, _ZERO_ROWS),)](
        topk_ids.reshape(-1), out, num_pairs, hidden, out.stride(0), ROWS=_ZERO_ROWS,
        BLOCK_H=_ZERO_COLS, num_warps=4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter), so that a
    persistent launch's programs still walk several tiles each in the CPU tests."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def _kernel() -> Any:
    """Build `_fused_moe_kernel` on first use (the only place triton is imported).

    The kernel calls only builtins of triton.language, none of its @jit helpers (tl.zeros,
    tl.cdiv, tl.sigmoid): those are bound when triton is imported, so under TRITON_INTERPRET=1
    set after that import they would fail, while builtins are interpreted either way. `tl` is
    bound as a module global: Triton's interpreter resolves names in the function's module.
    """
    global tl, _tile_coords, _tile, _sub_rows
    import triton
    import triton.language as tl

    _tile_coords, _tile, _sub_rows = (triton.jit(_tile_coords), triton.jit(_tile),
                                      triton.jit(_sub_rows))  # module globals, as tl

    # step-varying sizes exempt from Triton's value specialization (paged_attention_triton.py)
    @triton.jit(do_not_specialize=["num_pairs", "num_blocks", "num_programs"])
    def _fused_moe_kernel(
            a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr,
            num_pairs, num_blocks, num_programs, N, K, up_offset,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            A_ROW_DIV: tl.constexpr, C_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
            MUL_WEIGHT: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr,
            PERSISTENT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            B_WIDTH: tl.constexpr, HALF_M: tl.constexpr, QUARTER_M: tl.constexpr):
        pid = tl.program_id(0)
        num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
        if PERSISTENT:  # the used blocks only: every one has an expert (>= 0)
            used_blocks = tl.load(post_padded_ptr) // BLOCK_M
            for tile in tl.range(pid, used_blocks * num_pid_n, num_programs, flatten=True):
                pid_m, pid_n = _tile_coords(tile, used_blocks, num_pid_n, GROUP_M)
                _tile(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, pid_m, pid_n,
                      tl.load(expert_ids_ptr + pid_m), num_pairs, N, K, up_offset,
                      stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm,
                      stride_cn, A_ROW_DIV, C_ROW_DIV, GATED, MUL_WEIGHT, ATOMIC, EVEN_K,
                      DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, B_WIDTH, BLOCK_M)
        else:
            pid_m, pid_n = _tile_coords(pid, num_blocks, num_pid_n, GROUP_M)
            expert = tl.load(expert_ids_ptr + pid_m)
            if expert >= 0:  # else past the used blocks
                if HALF_M == 0:  # constexpr: no SUB_M
                    _tile(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, pid_m, pid_n, expert,
                          num_pairs, N, K, up_offset, stride_am, stride_ak, stride_be,
                          stride_bn, stride_bk, stride_cm, stride_cn, A_ROW_DIV, C_ROW_DIV,
                          GATED, MUL_WEIGHT, ATOMIC, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N,
                          BLOCK_K, B_WIDTH, BLOCK_M)
                else:  # the real rows of the block come first: a tile of their height
                    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
                    real = tl.sum((ids < num_pairs).to(tl.int32), axis=0)
                    rows = _sub_rows(real, BLOCK_M, HALF_M, QUARTER_M)  # 0, 1 or 2
                    if rows == 0:
                        _tile(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, pid_m, pid_n,
                              expert, num_pairs, N, K, up_offset, stride_am, stride_ak,
                              stride_be, stride_bn, stride_bk, stride_cm, stride_cn, A_ROW_DIV,
                              C_ROW_DIV, GATED, MUL_WEIGHT, ATOMIC, EVEN_K, DOT_PRECISION,
                              BLOCK_M, BLOCK_N, BLOCK_K, B_WIDTH, BLOCK_M)
                    elif rows == 1:
                        _tile(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, pid_m, pid_n,
                              expert, num_pairs, N, K, up_offset, stride_am, stride_ak,
                              stride_be, stride_bn, stride_bk, stride_cm, stride_cn, A_ROW_DIV,
                              C_ROW_DIV, GATED, MUL_WEIGHT, ATOMIC, EVEN_K, DOT_PRECISION,
                              BLOCK_M, BLOCK_N, BLOCK_K, B_WIDTH, HALF_M)
                    elif QUARTER_M > 0:  # constexpr: a quarter tile exists (>= 16 rows)
                        _tile(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, pid_m, pid_n,
                              expert, num_pairs, N, K, up_offset, stride_am, stride_ak,
                              stride_be, stride_bn, stride_bk, stride_cm, stride_cn, A_ROW_DIV,
                              C_ROW_DIV, GATED, MUL_WEIGHT, ATOMIC, EVEN_K, DOT_PRECISION,
                              BLOCK_M, BLOCK_N, BLOCK_K, B_WIDTH, QUARTER_M)

    return _fused_moe_kernel


@functools.cache
def _zero_kernel() -> Any:
    """Build `_zero_rows_kernel` on first use (builtins of triton.language only, as `_kernel`):
    program r zeroes, across all H columns, those of pair rows [r * ROWS, (r + 1) * ROWS) whose
    id is negative (-1: the expert is on another rank); other rows are masked off."""
    global tl
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_pairs"])
    def _zero_rows_kernel(ids_ptr, out_ptr, num_pairs, H, stride_m, ROWS: tl.constexpr,
                          BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        ids = tl.load(ids_ptr + rows, mask=rows < num_pairs, other=0)
        off_rank = ids < 0  # [ROWS]
        cols = tl.arange(0, BLOCK_H)
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_m + cols[None, :]
        zeros = tl.full((ROWS, BLOCK_H), 0.0, out_ptr.dtype.element_ty)
        for h in range(0, H, BLOCK_H):
            tl.store(ptrs + h, zeros, mask=off_rank[:, None] & (cols < H - h)[None, :])

    return _zero_rows_kernel


# ---- Triton helpers (jitted by _kernel; module globals, as the interpreter resolves names) ----

def _tile_coords(tile, num_blocks, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, N-tile) of a tile id: GROUP_M row blocks side by side per N-tile, so
    blocks of one expert share B tiles in L2."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile // group_size) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (tile % group_size) % group_m, (tile % group_size) // group_m


def _sub_rows(real, BLOCK_M: tl.constexpr, HALF_M: tl.constexpr, QUARTER_M: tl.constexpr):
    """Which tile a block with `real` rows takes under SUB_M: 2 (a quarter of BLOCK_M, when
    QUARTER_M > 0 and they fit), 1 (a half), 0 (the whole block)."""
    which = (real <= HALF_M).to(tl.int32)
    if QUARTER_M > 0:
        which += (real <= QUARTER_M).to(tl.int32)
    return which


def _tile(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, pid_m, pid_n, expert,
          num_pairs, N, K, up_offset,
          stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
          A_ROW_DIV: tl.constexpr, C_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
          MUL_WEIGHT: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr,
          DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, B_WIDTH: tl.constexpr, ROWS: tl.constexpr):
    """One [ROWS, BLOCK_N] output tile: the first ROWS (BLOCK_M, or a half or quarter of it
    with SUB_M) rows of row block pid_m (expert `expert`). B_WIDTH is BLOCK_N, or 2 * BLOCK_N
    for a gated launch with ONE_DOT: its weight tile's column 2j is gate row j, column 2j + 1
    up row j (= N + j), one dot of that width split in the epilogue."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, ROWS)
    pairs = tl.load(sorted_ids_ptr + offs_m)  # [ROWS]; P is a multiple of BLOCK_M
    row_ok = pairs < num_pairs  # padding holds the sentinel num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    if B_WIDTH == BLOCK_N:  # the weight rows they read; % N: in bounds unmasked, the store
        b_rows = offs_n % N  # masks the tail
    else:  # one dot: gate row j, up row N + j side by side
        col = tl.arange(0, B_WIDTH)
        b_rows = (pid_n * BLOCK_N + col // 2) % N + (col % 2) * N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be + b_rows[None, :] * stride_bn
              + offs_k[:, None] * stride_bk)  # [BLOCK_K, B_WIDTH] tile of w[e]^T

    acc = tl.full((ROWS, B_WIDTH), 0.0, dtype=tl.float32)
    acc_up = tl.full((ROWS, BLOCK_N), 0.0, dtype=tl.float32)  # the second dot's
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0  # unused (and dropped) when EVEN_K
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED and B_WIDTH == BLOCK_N:  # gate and up rows apart: a second dot
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset)
            else:
                b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATED:
        if B_WIDTH != BLOCK_N:  # one dot: columns 2j, 2j + 1 are gate j, up j
            acc, acc_up = tl.split(tl.reshape(acc, (ROWS, BLOCK_N, 2)))
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_rows = (pairs // C_ROW_DIV).to(tl.int64)
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_ok = row_ok[:, None] & (offs_n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(c_ptrs, acc, mask=c_ok, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_ok)


def _check_options(device: torch.device, combine: str, align: str) -> None:
    if combine not in _COMBINES:
        raise ValueError(f"combine must be one of {_COMBINES}, got {combine!r}")
    if align not in _ALIGNS:
        raise ValueError(f"align must be one of {tuple(_ALIGNS)}, got {align!r}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"moe_triton runs on CUDA tensors, or on {device.type} only under "
                         "Triton's interpreter (TRITON_INTERPRET=1 before importing triton)")


def _check_config(config: dict) -> None:
    """The tiles of both launches (`moe_configs.check_config`: a ValueError naming the key and
    value; host-side only, no sync)."""
    check_config(config)


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Shapes, dtypes, devices and strides, with an error naming what is wrong (no sync)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"want x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
                         f"(want [E, 2I, H]), w2 {tuple(w2.shape)} (want [E, H, I])")
    if x.dtype not in _DTYPES or not x.dtype == w13.dtype == w2.dtype:
        raise TypeError(f"x, w13, w2 must share one of {_DTYPES}; got {x.dtype}, {w13.dtype}, "
                        f"{w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T, k] with T = {x.shape[0]}, got "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be integer, got {topk_ids.dtype}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, strides {t.stride()}")
    if not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous, strides {topk_weights.stride()}")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
