"""Absorbed MLA decode, work-partitioned ("flat"): a fixed grid of programs, one an SM, each
walking a contiguous range of the step's flattened (decode row, key tile) list.

The split decode (absorbed_triton.py) runs one program a (head tile, row, split): at W1's
~200-token contexts that is 3-4 key tiles a program, and with one program an SM (its 200+
registers a thread) each program's q load, pipeline fill and output store are exposed: ~19.5 us
a program against ~3.7 us a tile in steady state on the H200 (36-38% of the read bound). Here a
program's loop runs on across row boundaries: the next tile's rows, and at a row change the
next row's q, are loaded during the current tile's dots, so the pipeline never drains between
rows, and the work is balanced by tiles, not rows (a long row is cut over several programs).

    cu_tiles [n + 1]  device cumsum of each decode row's tiles (at least one, so an empty
                      padding row is one tile of no keys and writes zeros)
    program p         tiles [p * per, min((p + 1) * per, total)), per = ceil(total / P)
      a row whole inside p        -> normalised store to out
      a row cut at p's edges      -> (max, sum, acc) partial: slot 1 in the row's first
                                     program, slot 0 in each later one
    _combine_kernel   program (p, head): the cut row that ends in p (p's first row, begun in an
                      earlier program), merged from its programs' slots into out

Same contract as the split decode's decode rows (mla_attention_triton); no host tensors and no
sync: the grid is the SM count, every length a device value, so CUDA graphs capture it at any
batch and context and replay it at any other (no split count fixed at capture).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.paged_triton import TileConfig
from moeserve.kernels.triton_common import next_pow2

SEARCH_BLOCK = 1024  # cu_tiles entries each program scans at once to find its first row
INTERPRETER_PROGRAMS = 3  # programs on CPU (Triton's interpreter): rows are cut between them

tl: Any = None  # triton.language, bound by _kernels(): the kernels below read it as a global
_attend_rows: Any = None  # absorbed_triton's jitted helpers, bound by _kernels() too
_tile_rows: Any = None
_sum: Any = None


def default_num_programs(device: torch.device) -> int:
    """One program an SM on CUDA (each holds a whole SM's registers); a few on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def decode_flat(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, kv_lora_rank: int, out: torch.Tensor, rows: torch.Tensor | None,
                num_rows: int, cfg: TileConfig, num_programs: int | None = None) -> None:
    """Decode rows (one query each; `rows` [num_rows] int32 row ids, or None for rows 0..B-1)
    into out [T, H, L]. Inputs checked by the caller (mla_attention_triton). All query heads
    are one tile (BLOCK_H = next_pow2(H)): the caller takes this path up to 64 heads."""
    if num_rows == 0:
        return
    kern = _kernels()
    num_heads, dim = q.shape[1:]
    num_programs = num_programs or default_num_programs(q.device)
    key = ("mla_decode_flat", cfg.block_n, num_rows, rows is None)
    if key not in meta.derived:  # the step's first layer: later layers reuse it
        seq = meta.seq_lens[:num_rows] if rows is None else meta.seq_lens.index_select(0, rows)
        tiles = torch.clamp_min((seq + (cfg.block_n - 1)) // cfg.block_n, 1)
        cu = torch.zeros(num_rows + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(tiles, 0, out=cu[1:])
        meta.derived[key] = cu
    cu_tiles = meta.derived[key]
    part_m = torch.empty(num_programs, 2, num_heads, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(num_programs, 2, num_heads, kv_lora_rank, dtype=torch.float32,
                           device=q.device)
    cut_row = torch.empty(num_programs, dtype=torch.int32, device=q.device)
    row_ids = rows if rows is not None else meta.query_start_loc  # unused when USE_ROWS is off
    common = dict(NUM_PROGRAMS=num_programs, NUM_HEADS=num_heads,
                  BLOCK_H=max(16, next_pow2(num_heads)), L=kv_lora_rank, USE_ROWS=rows is not None)
    kern.decode[(num_programs,)](
        q, latent_cache, out, part_m, part_l, part_acc, cut_row,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, row_ids, cu_tiles, num_rows,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), R=dim - kv_lora_rank, BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_N=cfg.block_n, SEARCH_BLOCK=SEARCH_BLOCK, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    kern.combine[(num_programs, num_heads)](
        part_m, part_l, part_acc, cut_row, out, meta.query_start_loc, row_ids, cu_tiles,
        num_rows, out.stride(0), out.stride(1), **common, num_warps=4)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _attend_rows, _tile_rows, _sum, _both, _row_info, _program_range
    import triton
    import triton.language

    from moeserve.kernels.attention.mla import absorbed_triton

    absorbed_triton._kernels()
    tl = triton.language
    _attend_rows, _tile_rows = absorbed_triton._attend_rows, absorbed_triton._tile_rows
    _sum = absorbed_triton._sum  # not tl.sum: see paged_triton._max
    _both, _row_info = triton.jit(_both), triton.jit(_row_info)
    _program_range = triton.jit(_program_range)
    # the row count and the table's width vary by step; row ids may be sliced at any offset
    return SimpleNamespace(
        decode=triton.jit(_flat_decode_kernel, do_not_specialize=["num_rows", "stride_table"],
                          do_not_specialize_on_alignment=["rows_ptr"]),
        combine=triton.jit(_combine_kernel, do_not_specialize=["num_rows"],
                           do_not_specialize_on_alignment=["rows_ptr"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _row_info(i, rows_ptr, seq_lens_ptr, query_start_loc_ptr, cu_tiles_ptr,
              USE_ROWS: tl.constexpr):
    """Decode row i: (request row, its token, seq_len, first tile, end tile) in flat tiles."""
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    return (req, tl.load(query_start_loc_ptr + req), tl.load(seq_lens_ptr + req),
            tl.load(cu_tiles_ptr + i), tl.load(cu_tiles_ptr + i + 1))


def _both(mask, cond):
    """mask [..] and the scalar cond, compared to 0: Triton 3.6's interpreter makes int32 of a bool
    tensor and a bool scalar, which its loads refuse as a mask."""
    return (mask & cond) != 0


def _program_range(p, cu_tiles_ptr, num_rows, NUM_PROGRAMS: tl.constexpr):
    """Program p's flat tiles [g0, g1) and the tiles a program takes."""
    total = tl.load(cu_tiles_ptr + num_rows)
    per = tl.maximum((total + NUM_PROGRAMS - 1) // NUM_PROGRAMS, 1)
    g0 = tl.minimum(p * per, total)
    return g0, tl.minimum(g0 + per, total), per


def _flat_decode_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                        cut_row_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                        rows_ptr, cu_tiles_ptr, num_rows, scale_log2,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                        NUM_PROGRAMS: tl.constexpr, NUM_HEADS: tl.constexpr,
                        BLOCK_H: tl.constexpr, L: tl.constexpr, USE_ROWS: tl.constexpr,
                        R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        SEARCH_BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """Program p: its flat tiles, row after row, every query head at once."""
    p = tl.program_id(0)
    g0, g1, per = _program_range(p, cu_tiles_ptr, num_rows, NUM_PROGRAMS)
    # the first row: the number of rows whose tiles all end at or before g0
    i = tl.full([], 0, tl.int32)
    for c in range(0, num_rows, SEARCH_BLOCK):
        idx = c + 1 + tl.arange(0, SEARCH_BLOCK)
        ends = tl.load(cu_tiles_ptr + idx, mask=idx <= num_rows, other=g0 + 1)
        i += _sum((ends <= g0).to(tl.int32), 0)
    i = tl.minimum(i, num_rows - 1)
    req, tok, seq_len, t_begin, t_end = _row_info(i, rows_ptr, seq_lens_ptr,
                                                  query_start_loc_ptr, cu_tiles_ptr, USE_ROWS)
    # the row cut at p's start that also ends in p: the combine merges it (one owner a row)
    tl.store(cut_row_ptr + p, tl.where((g0 < g1) & (t_begin < g0) & (t_end <= g1), i, -1))
    head = tl.arange(0, BLOCK_H)
    h_ok = head < NUM_HEADS
    dl = tl.arange(0, L)
    dr = tl.arange(0, R)
    q_row = q_ptr + tok * stride_qt + head[:, None] * stride_qh  # [H', 1]
    q_lat = tl.load(q_row + dl[None, :], mask=h_ok[:, None], other=0.0)  # [H', L]
    q_pe = tl.load(q_row + L + dr[None, :], mask=h_ok[:, None], other=0.0)  # [H', R]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, L], 0.0, tl.float32)
    row, valid = _tile_rows(block_tables_ptr + req.to(tl.int64) * stride_table,
                            (g0 - t_begin) * BLOCK_N, seq_len, L, R, BLOCK_SIZE, BLOCK_N)
    valid = _both(valid, g0 < g1)
    first = t_begin == g0  # the current row's segment begins at its first tile
    for g in range(g0, g1):
        # the next tile's row (at most one on: every row has at least one tile) and its key
        # rows, looked up before this tile's dots, as the split decode's lookahead
        nxt = g + 1
        adv = nxt >= t_end
        more = nxt < g1
        i_n = tl.minimum(tl.where(adv, i + 1, i), num_rows - 1)
        req_n, tok_n, seq_n, tb_n, te_n = _row_info(i_n, rows_ptr, seq_lens_ptr,
                                                    query_start_loc_ptr, cu_tiles_ptr,
                                                    USE_ROWS)
        row_n, valid_n = _tile_rows(block_tables_ptr + req_n.to(tl.int64) * stride_table,
                                    (nxt - tb_n) * BLOCK_N, seq_n, L, R, BLOCK_SIZE, BLOCK_N)
        valid_n = _both(valid_n, more)
        acc, m_i, l_i = _attend_rows(q_lat, q_pe, acc, m_i, l_i, cache_ptr, row, valid,
                                     valid[None, :], scale_log2, L, R, True, IEEE)
        # branches, not selects: their work runs once a row, not once a tile
        if adv | ~more:  # the row's segment ends here
            if adv & first:  # the whole row in this program: its normalised output
                l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row of no keys (padding) writes 0
                tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + dl[None, :],
                         (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                         mask=h_ok[:, None])
            else:  # a segment of a row cut at p's edges: a partial
                slot = (p * 2 + first.to(tl.int32)) * NUM_HEADS + head  # [H']
                tl.store(part_m_ptr + slot, m_i, mask=h_ok)
                tl.store(part_l_ptr + slot, l_i, mask=h_ok)
                tl.store(part_acc_ptr + slot[:, None].to(tl.int64) * L + dl[None, :], acc,
                         mask=h_ok[:, None])
        if adv:  # the next row: its q (latency exposed once a row), an empty accumulator
            q_row = q_ptr + tok_n * stride_qt + head[:, None] * stride_qh
            q_lat = tl.load(q_row + dl[None, :], mask=h_ok[:, None], other=0.0)
            q_pe = tl.load(q_row + L + dr[None, :], mask=h_ok[:, None], other=0.0)
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_H], 0.0, tl.float32)
            acc = tl.full([BLOCK_H, L], 0.0, tl.float32)
        first = first | adv
        i, tok, t_end = i_n, tok_n, te_n
        row, valid = row_n, valid_n


def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, cut_row_ptr, out_ptr,
                    query_start_loc_ptr, rows_ptr, cu_tiles_ptr, num_rows,
                    stride_ot, stride_oh, NUM_PROGRAMS: tl.constexpr, NUM_HEADS: tl.constexpr,
                    BLOCK_H: tl.constexpr, L: tl.constexpr, USE_ROWS: tl.constexpr):
    """Program (p, head): the row cut at p's start that ends in p, if any, merged from the
    partials of every program it spans (slot 1 in its first, slot 0 after) into out."""
    p = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.load(cut_row_ptr + p)
    if i >= 0:
        _, _, per = _program_range(p, cu_tiles_ptr, num_rows, NUM_PROGRAMS)
        p_first = tl.load(cu_tiles_ptr + i) // per
        if USE_ROWS:
            req = tl.load(rows_ptr + i)
        else:
            req = i
        tok = tl.load(query_start_loc_ptr + req)
        dl = tl.arange(0, L)
        m = tl.full([1], float("-inf"), tl.float32)
        lsum = tl.full([1], 0.0, tl.float32)
        acc = tl.full([L], 0.0, tl.float32)
        for j in range(p_first, p + 1):
            slot = (j * 2 + (j == p_first).to(tl.int32)) * NUM_HEADS + head
            m_j = tl.load(part_m_ptr + slot + tl.full([1], 0, tl.int32))
            l_j = tl.load(part_l_ptr + slot + tl.full([1], 0, tl.int32))
            m_new = tl.maximum(m, m_j)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            a, b = tl.exp2(m - m_ref), tl.exp2(m_j - m_ref)
            acc_j = tl.load(part_acc_ptr + slot.to(tl.int64) * L + dl)
            acc = acc * a + acc_j * b
            lsum = lsum * a + l_j * b
            m = m_new
        lsum = tl.where(lsum == 0.0, 1.0, lsum)
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + dl,
                 (acc / lsum).to(out_ptr.dtype.element_ty))
