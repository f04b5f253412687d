"""DeepSeek Sparse Attention (DSA), Triton path: absorbed MLA of each query over the context
positions the lightning indexer selected (dsa/indexer_triton.py's `indexer_topk_triton`).

Same contract as `dsa_attention_ref` (dsa/reference.py); registered with the indexer as
the "triton" DSA backend (kernels/registry.py). Program (head tile, token, split): a token's
selected positions, BLOCK_N at a time, gathered through its row's block table (looked up a tile
ahead, as mla_triton's decode does), through mla_triton's `_attend_rows` (online softmax in
fp32); when the tokens are few each token's selection is split over programs and
mla_reduce_triton.reduce_splits combines the parts. Triton is imported and the kernel jitted
on first use (`_kernels`); on CPU it runs in Triton's interpreter (TRITON_INTERPRET=1).
On an sm90 GPU in bf16 / fp16 the call runs mla/decode_gluon.sparse_gluon instead (the same
contract on wgmma), unless `gluon=False` or a Triton tile is given.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve import envs
from moeserve.kernels.attention.dsa.indexer_triton import _check_common, _need, _pow2_16
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
from moeserve.kernels.attention.mla import decode_gluon
from moeserve.kernels.attention.mla import reduce_triton as mla_reduce_triton
from moeserve.kernels.attention.paged_triton import TileConfig
from moeserve.kernels.triton_common import next_pow2

# An experiment switch (off until the H200 times it: benchmarks/kernels/mla/kernels_dsa.py's
# sparse_mla_slots_ms; MOESERVE_DSA_SLOT_ROWS=1): the selection turned into cache rows by one
# small launch first (`selected_slots`), so that the attention loop loads each tile's rows
# with one load instead of a position load feeding a block-table load, in this kernel and in
# decode_gluon.sparse_gluon (its `slots`). The Triton kernel with it measured 20% faster at
# 128 tokens x 32k and 8-9% at 256, 7% slower at 32 x 64k (gpu_c432eb0/call4); the Gluon
# kernel's form is untimed. Its sm90 SASS holds 26 LDGs a loop against the dense decode's 9
# at (64, 32, 8, 3). The same rows and ops, so the same bits (tests).
slot_rows = envs.dsa_slot_rows()
tl: Any = None  # triton.language, bound by _kernels(): the kernel below reads it as a global
# mla_triton's jitted helpers, bound by _kernels() too (the kernel reads it by global name)
_attend_rows: Any = None
_query_heads: Any = None
_empty_state: Any = None


def dsa_attention_triton(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                         positions: torch.Tensor, scale: float, kv_lora_rank: int, *,
                         config: TileConfig | None = None,
                         num_splits: int | None = None, packed: bool = False,
                         gluon: bool | None = None) -> torch.Tensor:
    """Absorbed MLA of each query over its selected context positions only
    (`dsa_attention_ref`'s contract).

    Args:
        q: [T, H, L + R] (last dim contiguous) absorbed queries [q_nope @ W_UK | rotated q_rope].
        latent_cache: [num_blocks, block_size, L + R], contiguous, q's dtype.
        positions: [T, topk] int32 (last dim contiguous) from the indexer; -1 (or a position
            past the row's block table) is skipped.
        kv_lora_rank: L; the values are the first L entries of each cached row. L and R powers
            of two >= 16.
        config: tile shape (block_m: heads per program, block_n: positions per iteration);
            default mla_triton's decode tiles.
        num_splits: partitions of each token's selection, run by programs of their own and
            combined by mla_triton's split reduce (tests, benchmarks); default
            mla_triton.decode_num_splits over (tokens, head tiles, topk): about two
            programs an SM when the tokens are few.
        packed: the positions are an indexer's, valid ones first and at most position + 1 of
            them: each token's loop stops at its context (`_sparse_attention_kernel`).
        gluon: run mla/decode_gluon.sparse_gluon (wgmma, sm90) instead of the Triton kernel;
            default (None) wherever it takes the inputs and no Triton tile is given.
    Returns:
        [T, H, L] contiguous, q's dtype (softmax in fp32). A token with no valid position gets
        zeros (the reference's softmax over nothing gives NaN there).
    """
    _check_attention_inputs(q, latent_cache, meta, positions, kv_lora_rank)
    if gluon is None:
        gluon = config is None and decode_gluon.supports(q, latent_cache, kv_lora_rank)
    if gluon:
        return decode_gluon.sparse_gluon(q, latent_cache, meta, positions, scale, kv_lora_rank,
                                         num_splits=num_splits, packed=packed, slots=slot_rows)
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    cfg = config or mla_triton.default_config("sparse", kv_lora_rank, q.dtype, num_heads)
    num_head_tiles, per_tile = mla_triton.head_tiles(num_heads, cfg.block_m)
    topk = positions.shape[1]
    if num_splits is None:  # host ints only: the same count inside a CUDA graph
        num_splits = mla_triton.decode_num_splits(num_tokens, num_head_tiles, topk, q.device)
    if not 1 <= num_splits <= mla_triton.MAX_SPLITS:
        raise ValueError(f"dsa_attention_triton: num_splits must be in 1..{mla_triton.MAX_SPLITS}, "
                         f"got {num_splits}")
    partition = -(-topk // num_splits)
    partition = -(-partition // cfg.block_n) * cfg.block_n  # whole tiles a partition
    split = num_splits > 1  # mla's partials layout, combined by its reduce
    part_m, part_l, part_acc = mla_reduce_triton.split_partials(out, num_tokens, num_splits)
    # a token's head tiles side by side in the grid (their reads of its selected latent rows
    # then hit L2), unless the tokens pass the grid's y limit
    tiles_first = num_tokens <= mla_triton.MAX_GRID_Y
    grid = ((num_head_tiles, num_tokens, num_splits) if tiles_first
            else (num_tokens, num_head_tiles, num_splits))
    kern = _kernels()
    sel = selected_slots(positions, meta, latent_cache.shape[1]) if slot_rows else positions
    kern.sparse_attention[grid](
        q, latent_cache, out, part_m, part_l, part_acc, sel, meta.block_tables,
        meta.token_to_req, meta.positions, scale * math.log2(math.e), topk,
        meta.block_tables.shape[1],
        partition, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), positions.stride(0),
        meta.block_tables.stride(0),
        NUM_HEADS=num_heads, HEADS_PER_TILE=per_tile, BLOCK_H=max(16, next_pow2(per_tile)),
        L=kv_lora_rank, R=dim - kv_lora_rank, BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_N=cfg.block_n, IEEE=q.dtype == torch.float32, TILES_FIRST=tiles_first,
        SPLIT=split, PACKED=packed, SLOTS=slot_rows, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if split:
        mla_reduce_triton.reduce_splits(part_m, part_l, part_acc, out, None, None, num_tokens,
                                 num_splits)
    return out


def selected_slots(positions: torch.Tensor, meta: AttentionMetadata,
                   block_size: int) -> torch.Tensor:
    """The selection [T, topk] int32 as cache rows (-1 where a position is -1 or past its
    request's block table), by one launch of `_slots_kernel`; the same strides."""
    sel = torch.empty_like(positions)
    num_tokens, topk = positions.shape
    if num_tokens:
        _kernels().slots[(num_tokens, -(-topk // _SLOTS_BLOCK))](
            positions, meta.block_tables, meta.token_to_req, sel, topk,
            meta.block_tables.shape[1], positions.stride(0), meta.block_tables.stride(0),
            BLOCK_SIZE=block_size, BLOCK=_SLOTS_BLOCK)
    return sel


def _check_attention_inputs(q: torch.Tensor, latent_cache: torch.Tensor,
                            meta: AttentionMetadata, positions: torch.Tensor,
                            kv_lora_rank: int) -> None:
    """ValueError naming the first input the sparse attention kernel cannot take."""
    who = "dsa_attention_triton"
    need = functools.partial(_need, who)
    _check_common(who, q, latent_cache, meta, "latent_cache", fp8_cache=True)
    rope_dim = q.shape[-1] - kv_lora_rank
    need(_pow2_16(kv_lora_rank), f"kv_lora_rank {kv_lora_rank} must be a power of two >= 16")
    need(_pow2_16(rope_dim), f"rope dims R = {q.shape[-1]} - {kv_lora_rank} = {rope_dim} must "
                             "be a power of two >= 16")
    need(positions.dim() == 2 and positions.shape[0] == q.shape[0],
         f"positions must be [T, topk] with T = {q.shape[0]}, got {tuple(positions.shape)}")
    need(positions.dtype == torch.int32, f"positions must be int32, got {positions.dtype}")
    need(positions.device == q.device, f"positions on {positions.device}, q on {q.device}")
    need(positions.stride(1) == 1, f"positions' last dim must be contiguous, "
                                   f"{positions.stride()}")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now); the
    shared tile step is mla_triton's, jitted there."""
    global tl, _attend_rows, _query_heads, _empty_state, _selected_rows
    import triton
    import triton.language

    mla_triton._kernels()
    tl = triton.language
    _attend_rows = mla_triton._attend_rows
    _query_heads, _empty_state = mla_triton._query_heads, mla_triton._empty_state
    _selected_rows = triton.jit(_selected_rows)
    # step-varying ints are exempt from specialisation (see paged_triton._kernels)
    return SimpleNamespace(
        sparse_attention=triton.jit(_sparse_attention_kernel,
                                    do_not_specialize=["topk", "max_blocks", "partition",
                                                       "num_splits", "stride_table"]),
        slots=triton.jit(_slots_kernel, do_not_specialize=["topk", "max_blocks",
                                                           "stride_table"]))


_SLOTS_BLOCK = 1024  # selections a `_slots_kernel` program converts


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _slots_kernel(sel_ptr, block_tables_ptr, token_to_req_ptr, out_ptr, topk, max_blocks,
                  stride_sel, stride_table, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, block of BLOCK selections): token t's selected positions -> their cache rows
    (`_selected_rows`' rule: -1, or a position past the block table, gives -1), int32."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(sel_ptr + t * stride_sel + j, mask=j < topk, other=-1)
    valid = (pos >= 0) & (pos < max_blocks * BLOCK_SIZE)
    req = tl.load(token_to_req_ptr + t)
    block = tl.load(block_tables_ptr + req * stride_table + pos // BLOCK_SIZE, mask=valid,
                    other=0)
    slot = tl.where(valid, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(out_ptr + t * stride_sel + j, slot.to(tl.int32), mask=j < topk)


def _selected_rows(sel_ptr, table_ptr, j0, j_end, max_blocks, L: tl.constexpr, R: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr):
    """The cache element offsets [N] of selections j0 .. min(j0 + BLOCK_N, j_end) of one token
    (its row of the selection at sel_ptr, its request's block table at table_ptr), and which
    are valid [N]: -1 is none, and a position past the block table was never selected (kept
    from reading out of bounds). SLOTS: sel_ptr holds cache rows already (`_slots_kernel`)."""
    j = j0 + tl.arange(0, BLOCK_N)
    if SLOTS:
        slot = tl.load(sel_ptr + j, mask=j < j_end, other=-1)  # [N] cache rows
        return slot.to(tl.int64) * (L + R), slot >= 0
    pos = tl.load(sel_ptr + j, mask=j < j_end, other=-1)  # [N] context positions
    valid = (pos >= 0) & (pos < max_blocks * BLOCK_SIZE)
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    return (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * (L + R), valid


def _sparse_attention_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                             sel_ptr, block_tables_ptr, token_to_req_ptr, tok_pos_ptr,
                             scale_log2, topk,
                             max_blocks, partition, num_splits, stride_qt, stride_qh,
                             stride_ot, stride_oh, stride_sel, stride_table,
                             NUM_HEADS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                             BLOCK_H: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                             IEEE: tl.constexpr, TILES_FIRST: tl.constexpr,
                             SPLIT: tl.constexpr, PACKED: tl.constexpr,
                             SLOTS: tl.constexpr):
    """Program (head_tile, t, split), or (t, head_tile, split) without TILES_FIRST: the
    HEADS_PER_TILE query heads of head_tile for token t, over partition `split` of its `topk`
    selected positions (sel_ptr row t; the last partition runs to topk), BLOCK_N at a time.
    SPLIT: the partition's (max, sum, acc) go to the partials (mla_triton's layout).
    PACKED: the selection holds its valid positions first, at most position + 1 of them (the
    indexers' output: ascending positions, -1 after a short context), so the loop stops there; a
    context of 256 positions then costs its 256, not topk's 2,048 slots of mostly -1 (a CUDA
    graph's decode runs every row sparse: W1 on the glm-5 slice was 14% slower than dense MLA
    forced, gpu_b1fed26). SLOTS: sel_ptr holds cache rows (`slot_rows`), not positions."""
    if TILES_FIRST:
        head_tile = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)
    else:
        t = tl.program_id(0).to(tl.int64)
        head_tile = tl.program_id(1)
    split = tl.program_id(2)
    start = split * partition
    end = tl.where(split == num_splits - 1, topk, tl.minimum(topk, start + partition))
    if PACKED:  # past the token's own context: -1 only
        end = tl.minimum(end, tl.load(tok_pos_ptr + t).to(tl.int32) + 1)
    req = tl.load(token_to_req_ptr + t)
    h = tl.arange(0, BLOCK_H)  # [H'] head within the tile (padded)
    head = head_tile * HEADS_PER_TILE + h
    h_ok = (h < HEADS_PER_TILE) & (head < NUM_HEADS)
    dl = tl.arange(0, L)
    q_lat, q_pe = _query_heads(q_ptr, t, head, h_ok, stride_qt, stride_qh, L, R)
    m_i, l_i, acc = _empty_state(BLOCK_H, L)
    table = block_tables_ptr + req * stride_table
    sel = sel_ptr + t * stride_sel
    # each tile's positions and rows are looked up a tile ahead (see mla_triton's decode)
    row, valid = _selected_rows(sel, table, start, end, max_blocks, L, R, BLOCK_SIZE, BLOCK_N,
                                SLOTS)
    for j0 in range(start, end, BLOCK_N):
        row_next, valid_next = _selected_rows(sel, table, j0 + BLOCK_N, end, max_blocks, L, R,
                                              BLOCK_SIZE, BLOCK_N, SLOTS)
        acc, m_i, l_i = _attend_rows(q_lat, q_pe, acc, m_i, l_i, cache_ptr, row, valid,
                                     valid[None, :], scale_log2, L, R, True, IEEE)
        row, valid = row_next, valid_next
    if SPLIT:
        part = (t * NUM_HEADS + head) * num_splits + split  # [H']
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(part_acc_ptr + part[:, None] * L + dl[None, :], acc, mask=h_ok[:, None])
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no valid position: zeros
        o = acc / l_safe[:, None]
        tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + dl[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
