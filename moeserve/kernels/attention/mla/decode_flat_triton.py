"""Absorbed MLA decode, work-partitioned ("flat"): a fixed grid of programs, one an SM, each
walking a contiguous range of the step's flattened (decode row, key tile) list.

The split decode (absorbed_triton.py) runs one program a (head tile, row, split): at W1's
~200-token contexts that is 3-4 key tiles a program, and with one program an SM (its 200+
registers a thread) each program's q load, pipeline fill and output store are exposed: ~19.5 us
a program against ~3.7 us a tile in steady state on the H200 (36-38% of the read bound). Here a
program's loop runs on across row boundaries: the next tile's rows, and at a row change the
next row's q, are loaded during the current tile's dots, so the pipeline never drains between
rows, and the work is balanced by tiles, not rows (a long row is cut over several programs).

    program p         counts every decode row's key tiles itself (at least one a row, so
                      an empty padding row is one tile of no keys and writes zeros) and
                      takes tiles [p * per, min((p + 1) * per, total)), per = ceil(total / P)
      a row whole inside p        -> normalised store to out
      a row cut at p's edges      -> (max, sum, acc) partial: slot 1 in the row's first
                                     program, slot 0 in each later one
    _combine_kernel   program (p, head): the cut row that ends in p (p's first row, begun in an
                      earlier program), merged from its programs' slots into out

Per tile only the block-table lookup of the next tile is in the chain before its latent copies
(the next row's scalars are loaded a row ahead), as in the split decode.
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
INTERPRETER_SEARCH_BLOCK = 64  # ... in the interpreter (a masked [64, 64] sum, not a scan)
INTERPRETER_PROGRAMS = 3  # programs on CPU (Triton's interpreter): rows are cut between them

tl: Any = None  # triton.language, bound by _kernels(): the kernels below read it as a global
_attend_rows: Any = None  # absorbed_triton's jitted helpers, bound by _kernels() too
_tile_rows: Any = None
_query_heads: Any = None
_empty_state: Any = None
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
    are one tile (BLOCK_H = next_pow2(H)): the caller takes this path up to FLAT_MAX_HEADS."""
    if num_rows == 0:
        return
    kern = _kernels()
    num_heads, dim = q.shape[1:]
    num_programs = num_programs or default_num_programs(q.device)
    part_m = torch.empty(num_programs, 2, num_heads, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(num_programs, 2, num_heads, kv_lora_rank, dtype=torch.float32,
                           device=q.device)
    cut = torch.empty(num_programs, 2, dtype=torch.int32, device=q.device)
    row_ids = rows if rows is not None else meta.query_start_loc  # unused when USE_ROWS is off
    common = dict(NUM_HEADS=num_heads, L=kv_lora_rank, USE_ROWS=rows is not None)
    kern.decode[(num_programs,)](
        q, latent_cache, out, part_m, part_l, part_acc, cut,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, row_ids, num_rows,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), NUM_PROGRAMS=num_programs,
        BLOCK_H=max(16, next_pow2(num_heads)), R=dim - kv_lora_rank,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_N=cfg.block_n,
        SEARCH_BLOCK=SEARCH_BLOCK if q.is_cuda else INTERPRETER_SEARCH_BLOCK, SCAN=q.is_cuda,
        IEEE=q.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **common)
    kern.combine[(num_programs, num_heads)](
        part_m, part_l, part_acc, cut, out, meta.query_start_loc, row_ids, out.stride(0),
        out.stride(1), **common, num_warps=4)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _attend_rows, _tile_rows, _query_heads, _empty_state, _sum
    global _both, _add, _row, _tiles_of, _program_range
    import triton
    import triton.language

    from moeserve.kernels.attention.mla import absorbed_triton

    absorbed_triton._kernels()
    tl = triton.language
    _attend_rows, _tile_rows = absorbed_triton._attend_rows, absorbed_triton._tile_rows
    _sum = absorbed_triton._sum  # not tl.sum: see paged_triton._max
    _query_heads, _empty_state = absorbed_triton._query_heads, absorbed_triton._empty_state
    _both, _add, _row = triton.jit(_both), triton.jit(_add), triton.jit(_row)
    _tiles_of, _program_range = triton.jit(_tiles_of), triton.jit(_program_range)
    # the row count and the table's width vary by step; row ids may be sliced at any offset
    return SimpleNamespace(
        decode=triton.jit(_flat_decode_kernel, do_not_specialize=["num_rows", "stride_table"],
                          do_not_specialize_on_alignment=["rows_ptr"]),
        combine=triton.jit(_combine_kernel, do_not_specialize_on_alignment=["rows_ptr"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _add(a, b):
    return a + b


def _both(mask, cond):
    """mask [..] and the scalar cond, compared to 0: Triton 3.6's interpreter makes int32 of a
    bool tensor and a bool scalar, which its loads refuse as a mask."""
    return (mask & cond) != 0


def _row(i, num_rows, rows_ptr, seq_lens_ptr, query_start_loc_ptr, USE_ROWS: tl.constexpr,
         BLOCK_N: tl.constexpr):
    """Decode row i (clamped to the last): (its request row, token, seq_len, key tiles)."""
    i = tl.minimum(i, num_rows - 1)
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    seq = tl.load(seq_lens_ptr + req)
    tiles = tl.maximum((seq + BLOCK_N - 1) // BLOCK_N, 1)
    return req, tl.load(query_start_loc_ptr + req), seq, tiles


def _tiles_of(c, num_rows, rows_ptr, seq_lens_ptr, USE_ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """The key tiles [SEARCH_BLOCK] of decode rows c .. c + SEARCH_BLOCK (0 past num_rows;
    at least one a row, so a padding row of no keys is a tile that writes zeros)."""
    r = c + tl.arange(0, SEARCH_BLOCK)
    ok = r < num_rows
    if USE_ROWS:
        req = tl.load(rows_ptr + r, mask=ok, other=0)
    else:
        req = r
    seq = tl.load(seq_lens_ptr + req, mask=ok, other=0)
    return tl.where(ok, tl.maximum((seq + BLOCK_N - 1) // BLOCK_N, 1), 0)


def _program_range(p, num_rows, rows_ptr, seq_lens_ptr, NUM_PROGRAMS: tl.constexpr,
                   USE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                   SCAN: tl.constexpr):
    """Program p's flat tiles [g0, g1), the tiles a program takes, its first row and the flat
    index of that row's first tile (every program counts the rows' tiles itself: no host
    tensor, nothing cached across CUDA-graph replays)."""
    total = tl.full([], 0, tl.int32)
    for c in tl.range(0, num_rows, SEARCH_BLOCK, num_stages=1):
        total += _sum(_tiles_of(c, num_rows, rows_ptr, seq_lens_ptr, USE_ROWS, BLOCK_N,
                                SEARCH_BLOCK), 0)
    per = tl.maximum((total + NUM_PROGRAMS - 1) // NUM_PROGRAMS, 1)
    g0 = tl.minimum(p * per, total)
    # the first row: the rows whose tiles all end at or before g0, and their tiles
    i = tl.full([], 0, tl.int32)
    t_begin = tl.full([], 0, tl.int32)
    for c in tl.range(0, num_rows, SEARCH_BLOCK, num_stages=1):
        t = _tiles_of(c, num_rows, rows_ptr, seq_lens_ptr, USE_ROWS, BLOCK_N, SEARCH_BLOCK)
        if SCAN:  # compiled: a scan
            ends = tl.associative_scan(t, 0, _add) + t_begin  # inclusive, from row c on
        else:  # Triton's interpreter runs a scan's combine per element in Python: a masked sum
            k = tl.arange(0, SEARCH_BLOCK)
            ends = _sum(tl.where(k[None, :] <= k[:, None], t[None, :], 0), 1) + t_begin
        before = (ends <= g0) & (t > 0)
        i += _sum(before.to(tl.int32), 0)
        t_begin += _sum(tl.where(before, t, 0), 0)
    return g0, tl.minimum(g0 + per, total), per, i, t_begin


def _flat_decode_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                        cut_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                        rows_ptr, num_rows, scale_log2,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                        NUM_PROGRAMS: tl.constexpr, NUM_HEADS: tl.constexpr,
                        BLOCK_H: tl.constexpr, L: tl.constexpr, USE_ROWS: tl.constexpr,
                        R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        SEARCH_BLOCK: tl.constexpr, SCAN: tl.constexpr, IEEE: tl.constexpr):
    """Program p: its flat tiles, row after row, every query head at once."""
    p = tl.program_id(0)
    g0, g1, per, i, t_begin = _program_range(p, num_rows, rows_ptr, seq_lens_ptr,
                                             NUM_PROGRAMS, USE_ROWS, BLOCK_N, SEARCH_BLOCK, SCAN)
    i = tl.minimum(i, num_rows - 1)
    req, tok, seq_len, tiles = _row(i, num_rows, rows_ptr, seq_lens_ptr, query_start_loc_ptr,
                                    USE_ROWS, BLOCK_N)
    t_end = t_begin + tiles
    # the row cut at p's start that also ends in p: the combine merges it (one owner a row),
    # from the program its first tile is in
    owned = (g0 < g1) & (t_begin < g0) & (t_end <= g1)
    tl.store(cut_ptr + 2 * p, tl.where(owned, i, -1))
    tl.store(cut_ptr + 2 * p + 1, t_begin // per)
    head = tl.arange(0, BLOCK_H)
    h_ok = head < NUM_HEADS
    dl = tl.arange(0, L)
    q_lat, q_pe = _query_heads(q_ptr, tok, head, h_ok, stride_qt, stride_qh, L, R)
    m_i, l_i, acc = _empty_state(BLOCK_H, L)
    row, valid = _tile_rows(block_tables_ptr + req.to(tl.int64) * stride_table,
                            (g0 - t_begin) * BLOCK_N, seq_len, L, R, BLOCK_SIZE, BLOCK_N)
    valid = _both(valid, g0 < g1)
    first = t_begin == g0  # the current row's segment begins at its first tile
    # the next row's scalars, one row ahead: a row change then loads nothing in the chain in
    # front of the next tile's latent copies (only its block-table entries, as the split
    # decode's lookahead)
    req_x, tok_x, seq_x, tiles_x = _row(i + 1, num_rows, rows_ptr, seq_lens_ptr,
                                        query_start_loc_ptr, USE_ROWS, BLOCK_N)
    n0 = (g0 - t_begin) * BLOCK_N  # the current tile's first key
    for g in range(g0, g1):
        nxt = g + 1
        adv = nxt >= t_end  # the next tile is the next row's first
        more = nxt < g1
        n0_n = tl.where(adv, 0, n0 + BLOCK_N)
        req_n = tl.where(adv, req_x, req)
        seq_n = tl.where(adv, seq_x, seq_len)
        row_n, valid_n = _tile_rows(block_tables_ptr + req_n.to(tl.int64) * stride_table, n0_n,
                                    seq_n, L, R, BLOCK_SIZE, BLOCK_N)
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
        if adv:  # on to the next row: its q (latency exposed once a row), an empty state
            q_lat, q_pe = _query_heads(q_ptr, tok_x, head, h_ok, stride_qt, stride_qh, L, R)
            m_i, l_i, acc = _empty_state(BLOCK_H, L)
        # the scalars by selects, not in the branch: what the next tile's addresses hang on
        # stays out of the branch's results (Triton's pipeliner then keeps the latent copies
        # in flight; from the branch it gave up: sm90 SASS at 32 registers, 13 KB spilled)
        req_y, tok_y, seq_y, tiles_y = _row(i + 2, num_rows, rows_ptr, seq_lens_ptr,
                                            query_start_loc_ptr, USE_ROWS, BLOCK_N)
        i = tl.where(adv, i + 1, i)
        tok = tl.where(adv, tok_x, tok)
        t_end = tl.where(adv, t_end + tiles_x, t_end)
        req_x = tl.where(adv, req_y, req_x)
        tok_x = tl.where(adv, tok_y, tok_x)
        seq_x = tl.where(adv, seq_y, seq_x)
        tiles_x = tl.where(adv, tiles_y, tiles_x)
        first = first | adv
        req, seq_len, n0 = req_n, seq_n, n0_n
        row, valid = row_n, valid_n


def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, cut_ptr, out_ptr,
                    query_start_loc_ptr, rows_ptr, stride_ot, stride_oh,
                    NUM_HEADS: tl.constexpr, L: tl.constexpr, USE_ROWS: tl.constexpr):
    """Program (p, head): the row cut at p's start that ends in p, if any, merged from the
    partials of every program it spans (slot 1 in its first, slot 0 after) into out."""
    p = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.load(cut_ptr + 2 * p)
    if i >= 0:
        p_first = tl.load(cut_ptr + 2 * p + 1)
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
