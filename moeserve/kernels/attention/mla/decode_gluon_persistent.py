"""Absorbed MLA decode in Gluon, persistent (an experiment, off until the H200 times it):
`decode_persistent`, decode_gluon.decode_gluon's contract without context splits.

Why: decode_gluon runs one program an SM (about 225 KB of shared memory; its accumulator
alone is 128 registers a thread, so two programs an SM cannot fit), and each program loads its
row's queries, walks the row's key tiles and stores the row's output in turn. At W1's short
contexts (129-256 keys: 3-4 tiles of 64) that prologue and epilogue are a large share of a
program, and nothing overlaps them: 43-46% of the read bound at 1,024-2,048 rows against
62-72% at 1k-4k keys (benchmarks/results/gpu_5bd5ebf/call1). FlashMLA's answer is a
persistent kernel whose key pipeline runs across rows.

    grid (programs = min(items, SMs)); items = (head tile, row), program p takes items
    p, p + P, p + 2P, ... ; its key tiles form one stream:
      load cursor   issues tile t + STAGES - 1 of the stream (the next item's first tiles
                    while the current item's last run)
      compute cursor  S = Q K^T, online softmax, O += P V as decode_gluon, tile t
      at an item's last tile, once its scores are done, the next item's queries are copied
      into the query buffer (overlapping this tile's softmax, P V and the output store); the
      running max is reset to -inf, which zeroes the sum and accumulator on the next tile

The commit order keeps one wait rule for every tile (wait_group(1), two stages): a boundary
tile commits the next item's first keys before the next item's queries, both landed before
that item's first scores (with three stages its second keys would come first: not taken). No
split partitions: `decode_gluon.persistent` routes only launches that decode_gluon would run
unsplit (many rows); long contexts over few rows stay decode_gluon's.

The kernel reuses decode_gluon's jitted helpers (_load_tile, _scores, _query_rows), bound
here by `_kernels` after decode_gluon's own. `decode_gluon.persistent` (an experiment switch:
MOESERVE_MLA_DECODE_PERSISTENT=1, envs.py) selects it.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import decode_gluon
from moeserve.kernels.triton_common import num_sms

gl: Any = None  # bound by _kernels(), as in decode_gluon
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
async_copy: Any = None
_load_tile: Any = None
_scores: Any = None
_query_rows: Any = None
_softmax_to_p: Any = None
_item: Any = None
_advance: Any = None
_copy_queries: Any = None
_store_output: Any = None


def decode_persistent(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, kv_lora_rank: int, out: torch.Tensor,
                      rows: torch.Tensor | None, num_rows: int, block_n: int | None = None,
                      stages: int | None = None, programs: int | None = None) -> None:
    """Decode rows (one query each) into out [T, H, L]: `rows` [num_rows] int32 row ids, or
    None for rows 0..B-1 (decode_gluon.decode_gluon's contract). programs: the grid (default
    one an SM, at most the items)."""
    block_n, stages = decode_gluon.tile(block_n, stages, False)
    decode_gluon._check(q, latent_cache, kv_lora_rank, stages, False)
    if stages != 2:  # the wait rule at an item's first tile holds for two stages only
        raise ValueError(f"decode_persistent: stages must be 2, got {stages}")
    if num_rows == 0:
        return
    num_heads, dim = q.shape[1:]
    num_head_tiles = -(-num_heads // decode_gluon.BLOCK_H)
    num_items = num_head_tiles * num_rows
    programs = min(num_items, programs or num_sms(q.device))
    _kernels().decode[(programs,)](
        q, latent_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        rows if rows is not None else meta.query_start_loc, num_items,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_HEAD_TILES=num_head_tiles, L=kv_lora_rank,
        R=dim - kv_lora_rank, BLOCK_SIZE=latent_cache.shape[1], BLOCK_N=block_n,
        STAGES=stages, USE_ROWS=rows is not None, num_warps=decode_gluon.NUM_WARPS)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use, after decode_gluon's helpers (whose jitted forms it
    calls, bound here as module globals)."""
    global gl, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, async_copy
    global _load_tile, _scores, _query_rows, _softmax_to_p, _item, _advance, _copy_queries
    global _store_output
    global _persistent_kernel
    from triton.experimental import gluon

    decode_gluon._kernels()
    gl, async_copy = decode_gluon.gl, decode_gluon.async_copy
    fence_async_shared = decode_gluon.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = decode_gluon.warpgroup_mma, decode_gluon.warpgroup_mma_wait
    _load_tile, _scores = decode_gluon._load_tile, decode_gluon._scores
    _query_rows, _softmax_to_p = decode_gluon._query_rows, decode_gluon._softmax_to_p
    _item, _advance = gluon.jit(_item), gluon.jit(_advance)
    _copy_queries, _store_output = gluon.jit(_copy_queries), gluon.jit(_store_output)
    _persistent_kernel = gluon.jit(do_not_specialize=["num_items", "stride_table"],
                                   do_not_specialize_on_alignment=["rows_ptr"])(
        _persistent_kernel)
    return SimpleNamespace(decode=_persistent_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _item(w, num_items, rows_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
          stride_table, NUM_HEAD_TILES: gl.constexpr, BLOCK_N: gl.constexpr,
          USE_ROWS: gl.constexpr):
    """Item w's (head tile, first query token, keys, key tiles, block table row); past the
    last item, no keys and no tiles."""
    live = w < num_items
    wc = gl.minimum(w, num_items - 1)
    head_tile = wc % NUM_HEAD_TILES
    row = wc // NUM_HEAD_TILES
    if USE_ROWS:
        req = gl.load(rows_ptr + row)
    else:
        req = row
    tok = gl.load(query_start_loc_ptr + req).to(gl.int64)
    end = gl.where(live, gl.load(seq_lens_ptr + req), 0)
    tiles = gl.where(live, gl.maximum(gl.cdiv(end, BLOCK_N), 1), 0)
    table = block_tables_ptr + req.to(gl.int64) * stride_table
    return head_tile, tok, end, tiles, table


def _persistent_kernel(q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                       query_start_loc_ptr, rows_ptr, num_items, scale_log2, stride_qt,
                       stride_qh, stride_ot, stride_oh, stride_table,
                       NUM_HEADS: gl.constexpr, NUM_HEAD_TILES: gl.constexpr, L: gl.constexpr,
                       R: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, USE_ROWS: gl.constexpr):
    """Program p: items p, p + P, ... as one stream of key tiles (the module docstring)."""
    BH: gl.constexpr = 64
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    lat_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    pe_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [8, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, L // 2 if L <= 512
                                                               else 256, 16])
    q_lat_s = gl.allocate_shared_memory(dtype, [BH, L],
                                        gl.NVMMASharedLayout.get_default_for([BH, L], dtype))
    q_pe_s = gl.allocate_shared_memory(dtype, [BH, R],
                                       gl.NVMMASharedLayout.get_default_for([BH, R], dtype))
    k_lat_s = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, L], gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype))
    k_pe_s = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, R], gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype))
    p_s = gl.allocate_shared_memory(dtype, [BH, BLOCK_N],
                                    gl.NVMMASharedLayout.get_default_for([BH, BLOCK_N], dtype))
    dq = gl.arange(0, L, layout=gl.SliceLayout(0, lat_l))
    dp = gl.arange(0, R, layout=gl.SliceLayout(0, pe_l))
    nl = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lat_l))
    np_ = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pe_l))
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    stride_p = gl.num_programs(0)

    # compute cursor: item c_w, its tile c_t; load cursor: item l_w, its tile l_t
    c_w = gl.program_id(0)
    c_head, c_tok, c_end, c_tiles, c_table = _item(
        c_w, num_items, rows_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        stride_table, NUM_HEAD_TILES, BLOCK_N, USE_ROWS)
    _copy_queries(q_ptr, q_lat_s, q_pe_s, c_tok, c_head, stride_qt, stride_qh, dq, dp,
                  gl.SliceLayout(1, lat_l), gl.SliceLayout(1, pe_l), NUM_HEADS, L)
    l_w = c_w
    l_t = 0
    l_end = c_end
    l_tiles = c_tiles
    l_table = c_table
    for j in gl.static_range(STAGES - 1):  # the stream's first tiles in flight
        _load_tile(cache_ptr, l_table, cache_ptr, 0, l_t * BLOCK_N, l_end, k_lat_s.index(j),
                   k_pe_s.index(j), nl, dq, np_, dp, L, R, BLOCK_SIZE, False)
        async_copy.commit_group()
        l_w, l_t, l_end, l_tiles, l_table = _advance(
            l_w, l_t, l_end, l_tiles, l_table, stride_p, num_items, rows_ptr,
            query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, stride_table, NUM_HEAD_TILES,
            BLOCK_N, USE_ROWS)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.full([BH], 0.0, gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([BH, L], gl.float32, layout=o_l)
    s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_l)
    c_t = 0
    g = 0  # the stream's tile index: stage g % STAGES
    while c_w < num_items:
        gl.thread_barrier()  # every warpgroup is done with the stage the next copy overwrites
        _load_tile(cache_ptr, l_table, cache_ptr, 0, l_t * BLOCK_N, l_end,
                   k_lat_s.index((g + STAGES - 1) % STAGES),
                   k_pe_s.index((g + STAGES - 1) % STAGES), nl, dq, np_, dp, L, R, BLOCK_SIZE,
                   False)
        async_copy.commit_group()
        l_w, l_t, l_end, l_tiles, l_table = _advance(
            l_w, l_t, l_end, l_tiles, l_table, stride_p, num_items, rows_ptr,
            query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, stride_table, NUM_HEAD_TILES,
            BLOCK_N, USE_ROWS)
        async_copy.wait_group(STAGES - 1)  # tile g's keys (and its item's queries) landed
        gl.thread_barrier()
        fence_async_shared()
        s = _scores(q_lat_s, q_pe_s, k_lat_s.index(g % STAGES), k_pe_s.index(g % STAGES),
                    s_zero)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        last = c_t == c_tiles - 1
        n_w = c_w + stride_p
        if last:
            gl.thread_barrier()  # both warpgroups' scores read the queries: the next item's
            n_head, n_tok, n_end, n_tiles, n_table = _item(
                n_w, num_items, rows_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                stride_table, NUM_HEAD_TILES, BLOCK_N, USE_ROWS)
            if n_w < num_items:
                _copy_queries(q_ptr, q_lat_s, q_pe_s, n_tok, n_head, stride_qt, stride_qh,
                              dq, dp, gl.SliceLayout(1, lat_l), gl.SliceLayout(1, pe_l),
                              NUM_HEADS, L)
        s = gl.where((c_t * BLOCK_N + keys)[None, :] < c_end, s * scale_log2, float("-inf"))
        m_i, l_i, acc = _softmax_to_p(s, m_i, l_i, acc, p_s, o_l)
        acc = warpgroup_mma(p_s, k_lat_s.index(g % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if last:  # the item's output; the next item's softmax starts from -inf
            acc = _store_output(out_ptr, acc, l_i, c_tok, c_head, stride_ot, stride_oh, o_l,
                                NUM_HEADS, L)
            m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
            c_w = n_w
            c_head, c_tok, c_end, c_tiles, c_table = _item(
                c_w, num_items, rows_ptr, query_start_loc_ptr, seq_lens_ptr,
                block_tables_ptr, stride_table, NUM_HEAD_TILES, BLOCK_N, USE_ROWS)
            c_t = 0
        else:
            c_t += 1
        g += 1
    async_copy.wait_group(0)  # no copy left in flight at exit


def _advance(w, t, end, tiles, table, stride_p, num_items, rows_ptr, query_start_loc_ptr,
             seq_lens_ptr, block_tables_ptr, stride_table, NUM_HEAD_TILES: gl.constexpr,
             BLOCK_N: gl.constexpr, USE_ROWS: gl.constexpr):
    """The load cursor one tile on: the next tile of its item, or the program's next item's
    first (past the last item: no keys)."""
    t += 1
    if t >= tiles:
        w = w + stride_p
        _, _, end, tiles, table = _item(w, num_items, rows_ptr, query_start_loc_ptr,
                                        seq_lens_ptr, block_tables_ptr, stride_table,
                                        NUM_HEAD_TILES, BLOCK_N, USE_ROWS)
        t = 0
    return w, t, end, tiles, table


def _copy_queries(q_ptr, q_lat_s, q_pe_s, tok, head_tile, stride_qt, stride_qh, dq, dp,
                  lat_rows: gl.constexpr, pe_rows: gl.constexpr, NUM_HEADS: gl.constexpr,
                  L: gl.constexpr):
    """cp.async of an item's queries (padding heads zero-filled) into the query buffers, one
    commit group."""
    q_at, q_ok = _query_rows(tok, 0, 1, head_tile, stride_qt, stride_qh, lat_rows, NUM_HEADS,
                             64, 1, False)
    async_copy.async_copy_global_to_shared(q_lat_s, q_ptr + q_at[:, None] + dq[None, :],
                                           mask=q_ok[:, None])
    q_at, q_ok = _query_rows(tok, 0, 1, head_tile, stride_qt, stride_qh, pe_rows, NUM_HEADS,
                             64, 1, False)
    async_copy.async_copy_global_to_shared(q_pe_s, q_ptr + q_at[:, None] + L + dp[None, :],
                                           mask=q_ok[:, None])
    async_copy.commit_group()


def _store_output(out_ptr, acc, l_i, tok, head_tile, stride_ot, stride_oh,
                  o_l: gl.constexpr, NUM_HEADS: gl.constexpr, L: gl.constexpr):
    """An item's output rows, acc / l (an empty row writes 0), its real heads only; returns
    acc so scaled (in place: no second accumulator's registers; finite, so the next item's
    first rescale by 0 clears it)."""
    ho = head_tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
    do = gl.arange(0, L, layout=gl.SliceLayout(0, o_l))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    acc = acc * (1.0 / gl.where(l_o == 0.0, 1.0, l_o))[:, None]
    gl.store(out_ptr + tok * stride_ot + ho.to(gl.int64)[:, None] * stride_oh + do[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(ho < NUM_HEADS)[:, None])
    return acc
