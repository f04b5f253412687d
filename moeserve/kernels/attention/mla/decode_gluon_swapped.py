"""Absorbed MLA decode in Gluon with the products transposed, for few heads: `decode_swapped`,
decode_gluon.decode_gluon's contract for at most SWAPPED_HEADS query heads.

Why: wgmma's M is at least 64 a warpgroup, so decode_gluon pads a row's heads to 64 (20 heads:
69% of its tensor-core work is padding). At 64 heads its products cost about 121 FLOPs a cache
byte, and it runs at the same share of the read bound at 20 heads as at 64 (62-72% and 56-69%,
benchmarks/results/gpu_5bd5ebf/call1): the padded products, not the reads, set its pace. With
the keys as M and the heads as N (N may be 8-256), a 20-head row pays for 32:

    program (row, partition), 8 warps = 2 warpgroups, H = SWAPPED_HEADS (32) heads:
      Q  -> shared [H, L] + [H, R]             (cp.async, one group)
      keys tile j (64 latent rows) -> stage j % STAGES (cp.async, gluon_parts._load_tile)
      S^T = K_lat Q_lat^T + K_pe Q_pe^T        wgmma [64 keys, H], warpgroups split the heads
      online softmax over the keys (axis 0), fp32, base 2
      P^T -> shared [64, H] (bf16)
      O^T += V^T P^T,  V^T = K_lat^T           wgmma [L, H] (V^T read transposed from the
                                               stage), warpgroups split L

Half the tensor-core work of decode_gluon at 17-32 heads, and half its accumulator registers
(O^T [512, 32] fp32: 64 a thread). With two stages of 64 keys (147 KB) the queries (37 KB)
fill shared memory as decode_gluon's tile does.

`one_stage` (the default; MOESERVE_MLA_SWAPPED_ONE_STAGE=0 goes back to two stages): one
stage of keys, 115 KB of shared memory, so two programs share an SM (128 registers x 256
threads each: the register file exactly; 2 x (115,200 + 1,024 reserved) of 233,472 bytes),
each copying its next tile once its products are done. One program's copies then wait beside
the other's products and softmax, where with two stages one program's serial chain (scores,
softmax across warps, P V) holds the SM alone. On the H200 (benchmarks/results/gpu_ff7b345/,
kernels_mla at 20 heads, % of the max(read, compute) bound) one stage was faster at every
case: 70.5-90.2% at 256-2,048 rows x 1k-4k keys against 68.6-82.4% with two stages, and at
W1's short contexts (about 3 key tiles a row) 52.2 / 59.6% at 1,024 / 2,048 rows against
47.4 / 52.5%.

A tokens form (`attend_tokens`, a mixed step's absorbed attention as one launch, a program a
token over its causal context, in place of the decode and prefill_gluon.py launches) measured
slower at every case with either stage count (gpu_ff7b345: W1's mixed step 0.576 ms without
it, 0.717 / 0.608 with two / one stage) and was removed (it is in git's history at 90f405a).

A block-table prefetch (tile t + 2's table entries loaded during tile t, so tile t + 1's copy
needs no synchronous table load) measured slower on the H200 (gpu_70a3760/call1: 58-69% of the
bound against 68-82% without) and was removed (it is in git's history at 941ba87).

Splits and their partials are decode_gluon's (reduce_triton combines them).
`decode_gluon.swapped` (on unless MOESERVE_MLA_DECODE_SWAPPED=0, envs.py) routes
decode_gluon's launches of at most SWAPPED_HEADS heads here; the GPU tests compare it with the
dense expectation. Offline for sm90 (kernel_sass --swapped): one stage 128 registers (capped)
and 115,200 B of shared memory, two stages 121 registers and 189 KB, no spill either way; the
P V products are HGMMA 64x32x16 with A (V^T) read transposed.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import decode_gluon, gluon_parts, reduce_triton
from moeserve.kernels.triton_common import MAX_GRID_Y

SWAPPED_HEADS = 32  # heads a program: wgmma's N (a power of two for Gluon's shapes)
BLOCK_N = 64  # keys a tile: wgmma's M for one warpgroup
one_stage = envs.mla_swapped_one_stage()  # one key stage, two programs an SM (the docstring)
# ... whose registers are capped so that two programs of 256 threads fit the register file
# (sm90 offline: 128 and 132 with a split, then 128 with no spill either way)
ONE_STAGE_MAX_REGISTERS = 128
NUM_WARPS = 8
# A program an SM walking rows as one stream of key tiles (so a row's first copies overlap
# the previous row's last tile) ran 2-5% slower than this grid at every case on the H200
# (MOESERVE_MLA_SWAPPED_ROWS, gpu_4705423/call1): removed, in git's history at 4705423.

gl: Any = None  # bound by _kernels(), as in decode_gluon
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
async_copy: Any = None
_load_tile: Any = None
_valid_keys: Any = None
_nvmma_buffer: Any = None
_tile_step: Any = None
_decode_row: Any = None


def key_stages() -> int:
    """The kernel's key stages: one with `one_stage`, else two."""
    return 1 if one_stage else 2


def programs_per_sm() -> int:
    """Programs an SM holds at once: two with `one_stage`'s shared memory, else one."""
    return 2 if one_stage else 1


def takes(num_heads: int) -> bool:
    """Whether a decode of this many heads fits one program's heads."""
    return 0 < num_heads <= SWAPPED_HEADS


def decode_swapped(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, kv_lora_rank: int, out: torch.Tensor,
                   rows: torch.Tensor | None, num_rows: int, max_seq_len: int,
                   num_splits: int | None = None) -> None:
    """Decode rows (one query each) into out [T, H, L] (decode_gluon.decode_gluon's contract:
    `rows` [num_rows] int32 row ids, or None for rows 0..B-1); H at most SWAPPED_HEADS.
    num_splits: context partitions a row (default reduce_triton.decode_num_splits over one
    wave of programs, `programs_per_sm` of them an SM)."""
    decode_gluon._check(q, latent_cache, kv_lora_rank, key_stages(), False)
    num_heads = q.shape[1]
    if not takes(num_heads):
        raise ValueError(f"decode_swapped: at most {SWAPPED_HEADS} heads, got {num_heads}")
    if num_rows > MAX_GRID_Y:
        raise ValueError(f"decode_swapped: {num_rows} rows in one launch, at most "
                         f"{MAX_GRID_Y} (the grid's y dimension)")
    if num_rows == 0:
        return
    if num_splits is None:  # one wave of programs: two an SM with one stage
        num_splits = reduce_triton.decode_num_splits(
            num_rows, 1, max_seq_len, q.device, waves=decode_gluon.DECODE_WAVES * programs_per_sm())
    if not 1 <= num_splits <= reduce_triton.MAX_SPLITS:
        raise ValueError(f"decode_swapped: num_splits must be in 1..{reduce_triton.MAX_SPLITS}, "
                         f"got {num_splits}")
    partition = -(-max(1, max_seq_len) // num_splits)
    partition = -(-partition // BLOCK_N) * BLOCK_N  # whole key tiles a partition
    part_m, part_l, part_acc = reduce_triton.split_partials(out, num_rows, num_splits)
    _kernels().decode[(1, num_rows, num_splits)](
        q, latent_cache, out, part_m, part_l, part_acc, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, rows if rows is not None else meta.query_start_loc,
        scale * math.log2(math.e), partition, num_splits, meta.block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, L=kv_lora_rank, R=q.shape[2] - kv_lora_rank,
        BLOCK_SIZE=latent_cache.shape[1], USE_ROWS=rows is not None, SPLIT=num_splits > 1,
        VEC_STORE=decode_gluon.vector_stores, STAGES=key_stages(), num_warps=NUM_WARPS,
        **({"maxnreg": ONE_STAGE_MAX_REGISTERS} if one_stage else {}))
    if num_splits > 1:
        reduce_triton.reduce_splits(part_m, part_l, part_acc, out, meta.query_start_loc, rows,
                                    num_rows, num_splits)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit the kernel on first use, after decode_gluon's helpers (whose jitted forms it
    calls, bound here as module globals)."""
    global gl, fence_async_shared, warpgroup_mma, warpgroup_mma_wait, async_copy
    global _load_tile, _valid_keys, _nvmma_buffer, _mla_swapped_kernel, _tile_step, _decode_row
    from triton.experimental import gluon

    decode_gluon._kernels()
    gl, async_copy = decode_gluon.gl, decode_gluon.async_copy
    fence_async_shared = decode_gluon.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = decode_gluon.warpgroup_mma, decode_gluon.warpgroup_mma_wait
    parts = gluon_parts.jitted()
    _load_tile, _valid_keys, _nvmma_buffer = parts.load_tile, parts.valid_keys, parts.nvmma_buffer
    _decode_row = parts.decode_row
    _mla_swapped_kernel = gluon.jit(
        do_not_specialize=["partition", "num_splits", "max_blocks", "stride_table"],
        do_not_specialize_on_alignment=["rows_ptr"])(_mla_swapped_kernel)
    _tile_step = gluon.jit(_tile_step)
    return SimpleNamespace(decode=_mla_swapped_kernel)


# ---- Gluon functions (jitted by _kernels; module globals, where the compiler finds names) ----

def _mla_swapped_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, rows_ptr,
                        scale_log2, partition, num_splits, max_blocks, stride_qt, stride_qh,
                        stride_ot, stride_oh, stride_table,
                        NUM_HEADS: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
                        BLOCK_SIZE: gl.constexpr, USE_ROWS: gl.constexpr, SPLIT: gl.constexpr,
                        VEC_STORE: gl.constexpr, STAGES: gl.constexpr):
    """Program (0, i, split): decode row i's heads over its context partition `split` (the
    module docstring's data flow), with STAGES (1 or 2) key stages."""
    H: gl.constexpr = 32  # SWAPPED_HEADS
    BN: gl.constexpr = 64  # BLOCK_N
    NS: gl.constexpr = STAGES
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # the copies' pointer layouts (16-byte vectors along a row): the keys' as decode_gluon's,
    # the queries' over H rows; S^T's warpgroups side by side along the heads, O^T's along L
    lat_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    pe_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [8, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, H // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                  instr_shape=[16, H, 16])
    q_lat_s = _nvmma_buffer(dtype, [H, L])
    q_pe_s = _nvmma_buffer(dtype, [H, R])
    k_lat_s = _nvmma_buffer(dtype, [NS, BN, L])
    k_pe_s = _nvmma_buffer(dtype, [NS, BN, R])
    p_s = _nvmma_buffer(dtype, [BN, H])

    i = gl.program_id(1)
    split = gl.program_id(2)
    start = split * partition
    req, tok, seq_len = _decode_row(i, rows_ptr, query_start_loc_ptr, seq_lens_ptr, USE_ROWS)
    end = gl.where(split == num_splits - 1, seq_len, gl.minimum(seq_len, start + partition))
    table = block_tables_ptr + req.to(gl.int64) * stride_table
    max_pos = max_blocks * BLOCK_SIZE

    # the row's query heads (rows past NUM_HEADS zero-filled): one copy group
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, lat_l))
    dq = gl.arange(0, L, layout=gl.SliceLayout(0, lat_l))
    async_copy.async_copy_global_to_shared(
        q_lat_s, q_ptr + tok * stride_qt + hq.to(gl.int64)[:, None] * stride_qh + dq[None, :],
        mask=(hq < NUM_HEADS)[:, None])
    hp = gl.arange(0, H, layout=gl.SliceLayout(1, pe_l))
    dp = gl.arange(0, R, layout=gl.SliceLayout(0, pe_l))
    async_copy.async_copy_global_to_shared(
        q_pe_s, q_ptr + tok * stride_qt + hp.to(gl.int64)[:, None] * stride_qh + L + dp[None, :],
        mask=(hp < NUM_HEADS)[:, None])
    async_copy.commit_group()

    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BN)
    nl = gl.arange(0, BN, layout=gl.SliceLayout(1, lat_l))
    np_ = gl.arange(0, BN, layout=gl.SliceLayout(1, pe_l))
    _load_tile(cache_ptr, table, cache_ptr, max_pos, start, end, k_lat_s.index(0),
               k_pe_s.index(0), nl, dq, np_, dp, L, R, BLOCK_SIZE, False, False)
    async_copy.commit_group()

    m_i = gl.full([H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_l))
    l_i = gl.full([H], 0.0, gl.float32, layout=gl.SliceLayout(0, s_l))
    acc = gl.zeros([L, H], gl.float32, layout=o_l)  # O^T
    s_zero = gl.zeros([BN, H], gl.float32, layout=s_l)
    keys = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
    for t in range(num_tiles):
        if NS == 1:
            async_copy.wait_group(0)  # tile t's group (and the queries') landed
            gl.thread_barrier()
            fence_async_shared()  # the copies' writes, before the wgmmas read them
            m_i, l_i, acc = _tile_step(k_lat_s.index(0), k_pe_s.index(0), q_lat_s, q_pe_s,
                                       p_s, cache_ptr, max_pos, start + t * BN + keys, end,
                                       scale_log2, m_i, l_i, acc, s_zero, o_l)
            # every warpgroup is done reading the stage, then tile t + 1 (past the last: all
            # masked, no global read) is copied into it; no branch in the loop
            gl.thread_barrier()
            _load_tile(cache_ptr, table, cache_ptr, max_pos, start + (t + 1) * BN, end,
                       k_lat_s.index(0), k_pe_s.index(0), nl, dq, np_, dp, L, R, BLOCK_SIZE,
                       False, False)
            async_copy.commit_group()
        else:
            # every warpgroup is done with the stage the next copy overwrites (tile t - 1's)
            gl.thread_barrier()
            _load_tile(cache_ptr, table, cache_ptr, max_pos, start + (t + 1) * BN, end,
                       k_lat_s.index((t + 1) % NS), k_pe_s.index((t + 1) % NS), nl, dq, np_,
                       dp, L, R, BLOCK_SIZE, False, False)
            async_copy.commit_group()
            async_copy.wait_group(NS - 1)  # tile t's group (and the queries') landed
            gl.thread_barrier()
            fence_async_shared()  # the copies' writes, before the wgmmas read them
            m_i, l_i, acc = _tile_step(k_lat_s.index(t % NS), k_pe_s.index(t % NS), q_lat_s,
                                       q_pe_s, p_s, cache_ptr, max_pos, start + t * BN + keys,
                                       end, scale_log2, m_i, l_i, acc, s_zero, o_l)
    async_copy.wait_group(0)  # no copy left in flight at exit

    # VEC_STORE (decode_gluon.vector_stores): O^T leaves through a layout whose threads hold 8
    # consecutive latent columns of one head (16-byte stores along the output's rows, a warp
    # 256 columns of a head; the conversion's shared memory reuses the key stages, free by
    # now), else from the accumulator's own (two heads' values a thread: 2-byte pieces)
    st_l: gl.constexpr = (gl.BlockedLayout([8, 1], [32, 1], [2, 4], [0, 1]) if VEC_STORE
                          else o_l)
    d = gl.arange(0, L, layout=gl.SliceLayout(1, st_l))
    ho = gl.arange(0, H, layout=gl.SliceLayout(0, st_l))
    h_ok = ho < NUM_HEADS
    if SPLIT:
        hs = gl.arange(0, H, layout=gl.SliceLayout(0, s_l))
        part = (i * NUM_HEADS + hs) * num_splits + split
        gl.store(part_m_ptr + part, m_i, mask=hs < NUM_HEADS)
        gl.store(part_l_ptr + part, l_i, mask=hs < NUM_HEADS)
        part_o = (i * NUM_HEADS + ho) * num_splits + split
        gl.store(part_acc_ptr + part_o.to(gl.int64)[None, :] * L + d[:, None],
                 gl.convert_layout(acc, st_l), mask=h_ok[None, :])
    else:
        l_o = gl.convert_layout(l_i, gl.SliceLayout(0, o_l))
        o = acc / gl.where(l_o == 0.0, 1.0, l_o)[None, :]  # an empty row writes 0
        gl.store(out_ptr + tok * stride_ot + ho.to(gl.int64)[None, :] * stride_oh
                 + d[:, None], gl.convert_layout(o.to(dtype), st_l), mask=h_ok[None, :])


def _tile_step(k_lat, k_pe, q_lat, q_pe, p_s, cache_ptr, max_pos, keys, end, scale_log2, m_i,
               l_i, acc, s_zero, o_l: gl.constexpr):
    """One stage's keys (context positions `keys`, those < end read) for a row's heads:
    S^T = K_lat Q_lat^T + K_pe Q_pe^T (wgmma, keys as M), masked and scaled to base 2, the
    online softmax over the keys (axis 0, per head), P^T to shared memory, O^T += V^T P^T.
    Returns (m_i, l_i, acc)."""
    s = warpgroup_mma(k_lat, q_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(k_pe, q_pe.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    _, valid = _valid_keys(cache_ptr, max_pos, keys, end, False)
    s = gl.where(valid[:, None], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_l))[None, :]
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(k_lat.permute((1, 0)), p_s, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_new, l_i, acc
