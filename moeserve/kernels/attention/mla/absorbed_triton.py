"""Absorbed MLA attention over the paged latent cache, Triton path: decode (split-K for long
contexts) and prefill kernels.

Same contract as `mla_attention_ref` (mla/reference.py): causal attention of each row's
absorbed queries q [T, H, L + R] over its cached rows latent_cache [num_blocks, block_size,
L + R], one shared "head" for every query head (MQA): the score of head h and key j is
q[h, :L] . c_j[:L] + q[h, L:] . c_j[L:], the value is c_j[:L]. Registered as the "triton" MLA
backend. Triton is imported and the kernels jitted on first use (`_kernels`), as in
paged_triton.py; on CPU they run in Triton's interpreter (TRITON_INTERPRET=1).

    q [T, H, L + R] ----host split on meta.query_lens_np----+
      decode rows (query_len == 1)                           |  prefill rows (chunks, prefixes)
      _decode_kernel  grid (head tiles, rows, splits)        |  _prefill_kernel
        one program = a tile of heads of one row over one    |    grid (query tiles, head tiles)
        context partition: each cached tile [BLOCK_N, L+R]   |    one program = BLOCK_Q tokens x
        is loaded once and serves every head of the tile     |    a tile of heads, flattened to
      splits > 1: partial (max, sum, acc [L]) in fp32 ->     |    rows; causal masking on the
        mla_reduce_triton (rows, H)                          |    key tiles past the first query
    out [T, H, L] <------------------------------------------+

L + R (576 at DeepSeek's dims) is no power of two, so the latent part [.., L] and the rotary part
[.., R] are two tiles and the score two dots; the value tile is the latent tile already loaded
(transposed for the score dot). Keys are gathered token by token through the block table, so a
tile of BLOCK_N keys may span several blocks. Softmax is online, in fp32 and base 2; fp32 inputs
take IEEE dots (the reference's precision). Pure decode steps build no host tensors and never
sync: CUDA-graph capturable. The split count is fixed at launch from host ints (rows, head
tiles, meta.max_seq_len) and the last partition always runs to the row's seq_len, so a graph
captured at a shorter max_seq_len still attends every key.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.attention.checks import check_cache_and_step
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import decode_flat_triton, decode_gluon
from moeserve.kernels.attention.mla import prefill_gluon as gluon_prefill
from moeserve.kernels.attention.mla import reduce_triton as mla_reduce_triton
from moeserve.kernels.attention.mla.reduce_triton import decode_num_splits
from moeserve.kernels.attention.paged_triton import (
    MAX_SPLITS,
    TileConfig,
    _split_rows,
)
from moeserve.kernels.triton_common import MAX_GRID_Y, next_pow2

DECODE_FORMS = ("auto", "split", "flat", "gluon")
# the flat decode holds every head in one tile: at 64 heads its accumulator and the next row's
# q path spill (sm90 SASS: 1.2 KB at (64, 32, 8, 2)), so 64 and more take the split decode
FLAT_MAX_HEADS = 32
FLAT_AUTO_MAX_ROWS = 256  # "auto" takes the flat decode up to this many decode rows

tl: Any = None  # triton.language, bound by _kernels(): the kernels below read it as a global


def default_config(kind: str, kv_lora_rank: int, dtype: torch.dtype,
                   num_heads: int = 64) -> TileConfig:
    """Defaults for kind "decode", "sparse" (DSA's sparse MLA) or "prefill". block_m: decode,
    the query heads of one program (one row); prefill, its query rows (tokens x heads).
    block_n: keys per iteration. bf16 decode on the H200 (gpu_b9de9a5/call2_f3343e0/): up to
    32 heads one program over 64 keys a step (20 heads: 49-62% of the read bound at 1k-4k
    keys), more heads tiles of 64 (wgmma's rows), against 20-31% for the earlier (16, 64, 4,
    2); three stages keep a latent tile in flight during each tile's dots."""
    if kv_lora_rank <= 64:  # tiny test shapes: small tiles, so loops and masks run several times
        return TileConfig(16, 16, 2, 1)
    if kind in ("decode", "sparse"):
        if dtype == torch.float32:  # exact tests: fp32 tiles are twice the bytes
            return TileConfig(16, 32, 4, 2)
        if num_heads <= 32:
            return TileConfig(32, 64, 8, 3)
        # from 64 heads, 64 keys a step: 5-17% faster than (64, 32, 8, 3) in 15 of 16 cases
        # (gpu_2928ff4/call1_2928ff4/); DSA's sparse MLA likewise (gpu_039305d/call3_splits/)
        return TileConfig(64, 64, 8, 2)
    if dtype == torch.float32:
        return TileConfig(32, 32, 8, 1)
    # bf16 prefill: 64 rows a program (wgmma's M; at 20 heads 3 query tokens x 20 heads share
    # each latent tile), 3 stages; (32, 32, 8, 2) ran W1's prompts at 26 TFLOP/s
    # (gpu_b790193/call2_25bbc5a/)
    return TileConfig(64, 32, 8, 3)


def auto_decode_form(num_heads: int, num_rows: int, gluon: bool = False) -> str:
    """The decode form "auto" runs: gluon where decode_gluon takes the inputs (`gluon`: sm90,
    bf16 / fp16; H200, benchmarks/results/gpu_5bd5ebf/call1: 20 / 64 heads at 256-2,048 rows of
    1k-4k keys 62-72% / 56-69% of the read bound against split's 45-61% / 41-47%, W1's
    contexts 43-46% against 35-38%); else flat up to FLAT_AUTO_MAX_ROWS rows and
    FLAT_MAX_HEADS heads, split otherwise (gpu_504b028/call2_bf30b2d/: 20 heads, 256 rows of
    1k / 4k keys flat 37.7 / 51.4% against split 28.8 / 48.9%; from 1,024 rows split)."""
    if gluon:
        return "gluon"
    return ("flat" if num_heads <= FLAT_MAX_HEADS and num_rows <= FLAT_AUTO_MAX_ROWS
            else "split")


def head_tiles(num_heads: int, block_m: int) -> tuple[int, int]:
    """(number of head tiles, heads per tile): at most block_m heads per tile, balanced, so 20
    heads at block_m 16 are two tiles of 10."""
    num_tiles = -(-num_heads // max(1, block_m))
    return num_tiles, -(-num_heads // num_tiles)


def mla_attention_triton(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, kv_lora_rank: int, *, decode_splits: int | None = None,
                         decode_config: TileConfig | None = None,
                         prefill_config: TileConfig | None = None,
                         decode_form: str = "auto",
                         prefill_gluon: bool | None = None) -> torch.Tensor:
    """Absorbed MLA: causal attention of each row's queries over its cached latent rows.

    Args:
        q: [T, H, L + R] (last dim contiguous), each head's absorbed query [q_nope @ W_UK |
            rotated q_rope], tokens in the order of `meta`.
        latent_cache: [num_blocks, block_size, L + R], contiguous, q's dtype; the step's own
            rows already written. meta: the step's AttentionMetadata (on q's device).
        scale: the softmax scale.
        kv_lora_rank: L; the values are the first L entries of each cached row. L and
            R = q.shape[-1] - L must be powers of two >= 16.
        decode_splits: force the decode split count (tests); default `decode_num_splits`.
        decode_config, prefill_config: tile shapes (benchmarks); default `default_config`.
        decode_form: "split" (a program a head tile, row and context partition), "flat"
            (decode_flat_triton.py: a program an SM over the flattened row tiles), "gluon"
            (decode_gluon.py: split on wgmma, sm90) or "auto" (`auto_decode_form`; "split"
            whenever decode_splits is given, no gluon when decode_config is).
        prefill_gluon: prefill rows through mla/prefill_gluon.py; default (None)
            wherever it takes the inputs and no prefill_config is given.
    Returns:
        [T, H, L] contiguous, q's dtype.
    """
    _check_inputs(q, latent_cache, meta, kv_lora_rank)
    if decode_form not in DECODE_FORMS:
        raise ValueError(f"mla_attention_triton: decode_form {decode_form!r} not in "
                         f"{DECODE_FORMS}")
    if decode_form == "auto":  # split when a split count or Triton tile is forced
        gluon = decode_config is None and decode_gluon.supports(q, latent_cache, kv_lora_rank)
        decode_form = ("split" if decode_splits is not None else auto_decode_form(
            q.shape[1], int((meta.query_lens_np == 1).sum()), gluon))
    if decode_form == "flat" and q.shape[1] > FLAT_MAX_HEADS:
        raise ValueError(f"mla_attention_triton: the flat decode takes at most "
                         f"{FLAT_MAX_HEADS} heads, got {q.shape[1]}")
    num_tokens, num_heads = q.shape[:2]
    out = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    is_decode = meta.query_lens_np == 1  # [B]
    if bool(is_decode.all()):  # every index already on the device: no host work, no sync
        _launch_decode(q, latent_cache, meta, scale, kv_lora_rank, out, None, meta.num_reqs,
                       meta.max_seq_len, decode_splits, decode_config, decode_form)
        return out
    prefill_cfg = prefill_config or default_config("prefill", kv_lora_rank, q.dtype)
    if (prefill_config is None if prefill_gluon is None else prefill_gluon) and (
            decode_gluon.supports(q, latent_cache, kv_lora_rank)):
        prefill_cfg = None  # _launch_prefill's Gluon form
        block_q = gluon_prefill.prefill_block_q(num_heads)[2]
    else:
        block_q = _prefill_block_q(prefill_cfg, num_heads)
    key = ("mla_attention_triton", block_q, q.device)
    if key not in meta.derived:  # the step's first layer: later layers reuse it
        meta.derived[key] = _split_rows(meta, is_decode, block_q, q.device)
    dev, num_decode, num_tiles, max_seq = meta.derived[key]
    if num_decode:
        _launch_decode(q, latent_cache, meta, scale, kv_lora_rank, out, dev[:num_decode],
                       num_decode, max_seq, decode_splits, decode_config, decode_form)
    _launch_prefill(q, latent_cache, meta, scale, kv_lora_rank, out, dev[num_decode:],
                    num_tiles, prefill_cfg)
    return out


def _check_inputs(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                  kv_lora_rank: int) -> None:
    """ValueError naming the first input the kernels cannot take."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"mla_attention_triton: {what}")

    def pow2_16(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    need(q.dim() == 3, f"q must be [T, H, L + R], got shape {tuple(q.shape)}")
    need(latent_cache.dim() == 3,
         f"latent_cache must be [num_blocks, block_size, L + R], got {tuple(latent_cache.shape)}")
    dim = q.shape[2]
    _, block_size, cache_dim = latent_cache.shape
    need(dim == cache_dim, f"q's last dim {dim} != latent_cache's {cache_dim}")
    rope_dim = dim - kv_lora_rank
    need(pow2_16(kv_lora_rank), f"kv_lora_rank {kv_lora_rank} must be a power of two >= 16")
    need(pow2_16(rope_dim),
         f"rope dims R = {dim} - {kv_lora_rank} = {rope_dim} must be a power of two >= 16")
    check_cache_and_step("mla_attention_triton", q, latent_cache, "latent_cache", block_size,
                         meta)


def _prefill_block_q(cfg: TileConfig, num_heads: int) -> int:
    """Query tokens per prefill program: block_m rows hold block_q tokens x a tile of heads."""
    _, per_tile = head_tiles(num_heads, cfg.block_m)
    return max(1, cfg.block_m // per_tile)


def _launch_decode(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, kv_lora_rank: int, out: torch.Tensor,
                   rows: torch.Tensor | None, num_rows: int, max_seq_len: int,
                   num_splits: int | None, cfg: TileConfig | None, form: str) -> None:
    """Decode rows (one query each): `rows` [num_rows] int32 row ids, or None for rows 0..B-1."""
    kern = _kernels()
    num_heads, dim = q.shape[1:]
    cfg = cfg or default_config("decode", kv_lora_rank, q.dtype, num_heads)
    if form == "flat":
        decode_flat_triton.decode_flat(q, latent_cache, meta, scale, kv_lora_rank, out, rows,
                                       num_rows, cfg)
        return
    if form == "gluon":  # decode_gluon.py (wgmma, sm90)
        decode_gluon.decode_gluon(q, latent_cache, meta, scale, kv_lora_rank, out, rows,
                                  num_rows, max_seq_len, num_splits)
        return
    num_head_tiles, per_tile = head_tiles(num_heads, cfg.block_m)
    if num_splits is None:
        num_splits = decode_num_splits(num_rows, num_head_tiles, max_seq_len, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"mla_attention_triton: decode_splits must be in 1..{MAX_SPLITS}, "
                         f"got {num_splits}")
    partition = -(-max(1, max_seq_len) // num_splits)
    partition = -(-partition // cfg.block_n) * cfg.block_n  # whole key tiles per partition
    split = num_splits > 1
    part_m, part_l, part_acc = mla_reduce_triton.split_partials(out, num_rows, num_splits)
    row_ids = rows if rows is not None else meta.query_start_loc  # unused when USE_ROWS is off
    if num_rows > MAX_GRID_Y:
        raise ValueError(f"mla_attention_triton: {num_rows} decode rows in one launch, at most "
                         f"{MAX_GRID_Y} (the grid's y dimension)")
    # a row's head tiles side by side in the grid: they run at once and read the same latent
    # blocks, so all but the first read hit L2 (each tile reads the row's whole latent cache)
    kern.decode[(num_head_tiles, num_rows, num_splits)](
        q, latent_cache, out, part_m, part_l, part_acc,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, row_ids,
        scale * math.log2(math.e), partition, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, HEADS_PER_TILE=per_tile, BLOCK_H=max(16, next_pow2(per_tile)),
        L=kv_lora_rank, R=dim - kv_lora_rank, BLOCK_SIZE=latent_cache.shape[1],
        BLOCK_N=cfg.block_n, USE_ROWS=rows is not None, SPLIT=split,
        IEEE=q.dtype == torch.float32, **cfg.launch())
    if split:
        mla_reduce_triton.reduce_splits(part_m, part_l, part_acc, out, meta.query_start_loc,
                                        rows, num_rows, num_splits)


def _launch_prefill(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, kv_lora_rank: int, out: torch.Tensor, tiles: torch.Tensor,
                    num_tiles: int, cfg: TileConfig | None) -> None:
    """Prefill rows by query tile: `tiles` [2 * num_tiles] int32 = (row of each tile, tile index
    within the row); cfg None: mla/prefill_gluon.py."""
    if cfg is None:
        return gluon_prefill.prefill_gluon(q, latent_cache, meta, scale, kv_lora_rank, out,
                                           tiles, num_tiles)
    num_heads, dim = q.shape[1:]
    num_head_tiles, per_tile = head_tiles(num_heads, cfg.block_m)
    block_q = _prefill_block_q(cfg, num_heads)
    _kernels().prefill[(num_tiles, num_head_tiles)](
        q, latent_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles,
        num_tiles, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, HEADS_PER_TILE=per_tile, BLOCK_Q=block_q,
        BLOCK_M=max(16, next_pow2(block_q * per_tile)), L=kv_lora_rank, R=dim - kv_lora_rank,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_N=cfg.block_n, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now). Kernels
    call the helpers and read `tl` by global name (Triton resolves names in the module's
    globals), so those are bound here."""
    global tl, _attend_rows, _tile_rows, _query_heads, _empty_state, _max, _sum
    import triton
    import triton.language

    tl = triton.language
    _max, _sum = triton.jit(_max), triton.jit(_sum)
    _attend_rows = triton.jit(_attend_rows)
    _tile_rows = triton.jit(_tile_rows)
    _query_heads, _empty_state = triton.jit(_query_heads), triton.jit(_empty_state)
    # NOTE: step-varying ints (split partition and count, the block table's width, tile counts)
    # and index arrays sliced at any offset are exempt from specialisation: a new batch shape
    # must not compile a new variant mid-serving (see paged_triton._kernels).
    return SimpleNamespace(
        decode=triton.jit(_decode_kernel,
                          do_not_specialize=["partition", "num_splits", "stride_table"],
                          do_not_specialize_on_alignment=["rows_ptr"]),
        prefill=triton.jit(_prefill_kernel, do_not_specialize=["num_tiles", "stride_table"],
                           do_not_specialize_on_alignment=["tiles_ptr"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _max(x, AXIS: tl.constexpr):
    """Max over AXIS of fp32 x, without tl.max's own jit wrapper (see paged_triton._max)."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


def _sum(x, AXIS: tl.constexpr):
    """Sum over AXIS of fp32 x (see _max)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


def _tile_rows(table_ptr, n0, kv_end, L: tl.constexpr, R: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache element offsets [N] of keys n0 .. n0 + BLOCK_N of one row's paged context
    (0 past kv_end), and which of them are before kv_end [N]."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < kv_end
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    return (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * (L + R), valid


def _query_heads(q_ptr, tok, head, h_ok, stride_qt, stride_qh, L: tl.constexpr,
                 R: tl.constexpr):
    """Token tok's absorbed queries of heads `head` [H'] (0 where not h_ok): q_lat [H', L],
    q_pe [H', R]."""
    q_row = q_ptr + tok * stride_qt + head[:, None] * stride_qh  # [H', 1]
    q_lat = tl.load(q_row + tl.arange(0, L)[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + L + tl.arange(0, R)[None, :], mask=h_ok[:, None], other=0.0)
    return q_lat, q_pe


def _empty_state(BLOCK_H: tl.constexpr, L: tl.constexpr):
    """The online softmax's state before any key: running max, sum and accumulator."""
    return (tl.full([BLOCK_H], float("-inf"), tl.float32), tl.full([BLOCK_H], 0.0, tl.float32),
            tl.full([BLOCK_H, L], 0.0, tl.float32))


def _attend_rows(q_lat, q_pe, acc, m_i, l_i, cache_ptr, row, valid, keep, scale_log2,
                 L: tl.constexpr, R: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step of query rows (q_lat [M, L], q_pe [M, R]) over the cached latent
    rows at element offsets `row` [N] (a tile of the paged context, or DSA's selected
    positions). MASKED: rows not `valid` [N] are not read, scores not `keep` ([M, N] or
    [1, N]) are dropped; a query row that has seen no key yet stays empty (m -inf, l 0)."""
    dl = tl.arange(0, L)
    dr = tl.arange(0, R)
    if MASKED:
        kv = tl.load(cache_ptr + row[:, None] + dl[None, :], mask=valid[:, None], other=0.0)
        k_pe = tl.load(cache_ptr + row[None, :] + L + dr[:, None], mask=valid[None, :],
                       other=0.0)
    else:
        kv = tl.load(cache_ptr + row[:, None] + dl[None, :])  # [N, L] latents: keys and values
        k_pe = tl.load(cache_ptr + row[None, :] + L + dr[:, None])  # [R, N]
    # a float8 e4m3 cache read back in the queries' dtype (else no-op)
    kv, k_pe = kv.to(q_lat.dtype), k_pe.to(q_pe.dtype)
    # fp32: exact products (the reference's precision); half types: default tensor-core dots
    if IEEE:
        s = (tl.dot(q_lat, tl.trans(kv), input_precision="ieee")
             + tl.dot(q_pe, k_pe, input_precision="ieee"))
    else:
        s = tl.dot(q_lat, tl.trans(kv)) + tl.dot(q_pe, k_pe)
    s = s * scale_log2  # [M, N] base-2 logits
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, _max(s, 1))  # [M]
    # -inf while a row has seen no key (DSA: a tile of -1 positions): exp2 against 0 then
    # gives alpha 0 and p 0 instead of NaN
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)  # [M]
    p = tl.exp2(s - m_ref[:, None])  # [M, N]
    l_i = l_i * alpha + _sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    return acc, m_new, l_i


def _decode_kernel(q_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, rows_ptr,
                   scale_log2, partition, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                   NUM_HEADS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, BLOCK_H: tl.constexpr,
                   L: tl.constexpr, R: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, USE_ROWS: tl.constexpr, SPLIT: tl.constexpr,
                   IEEE: tl.constexpr):
    """Program (head_tile, i, split): the HEADS_PER_TILE query heads of head_tile for decode
    row i, over context partition `split` (the last one runs to seq_len)."""
    head_tile = tl.program_id(0)
    i = tl.program_id(1)
    split = tl.program_id(2)
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    tok = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * partition
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(seq_len, start + partition))
    h = tl.arange(0, BLOCK_H)  # [H'] head within the tile (padded)
    head = head_tile * HEADS_PER_TILE + h
    h_ok = (h < HEADS_PER_TILE) & (head < NUM_HEADS)
    dl = tl.arange(0, L)
    q_lat, q_pe = _query_heads(q_ptr, tok, head, h_ok, stride_qt, stride_qh, L, R)
    m_i, l_i, acc = _empty_state(BLOCK_H, L)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    # each tile's rows are looked up one tile ahead: the block-table load then is not in the
    # chain in front of the tile's latent loads, so from 3 stages Triton's pipeliner keeps a
    # tile of latents in flight during each tile's dots (with the lookup in the chain it waited
    # for every copy at the loop's top; with 2 stages the next tile's copies still start only
    # after this tile's dots: `kernel_sass mla-decode` reports the loop's copy wait)
    row, valid = _tile_rows(table, start, end, L, R, BLOCK_SIZE, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        row_next, valid_next = _tile_rows(table, n0 + BLOCK_N, end, L, R, BLOCK_SIZE, BLOCK_N)
        acc, m_i, l_i = _attend_rows(q_lat, q_pe, acc, m_i, l_i, cache_ptr, row, valid,
                                     valid[None, :], scale_log2, L, R, True, IEEE)
        row, valid = row_next, valid_next
    if SPLIT:
        part = (i * NUM_HEADS + head) * num_splits + split  # [H']
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(part_acc_ptr + part[:, None].to(tl.int64) * L + dl[None, :], acc,
                 mask=h_ok[:, None])
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty row (seq_len 0 padding) writes 0
        o = acc / l_safe[:, None]
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + dl[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _prefill_kernel(q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, tiles_ptr, num_tiles, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                    NUM_HEADS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, L: tl.constexpr,
                    R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr):
    """Program (t, head_tile): query tile t (BLOCK_Q tokens of one row) x the HEADS_PER_TILE
    heads of head_tile, flattened to rows r = token * HEADS_PER_TILE + head; causal over the
    row's paged context."""
    t = tl.program_id(0)
    head_tile = tl.program_id(1)
    req = tl.load(tiles_ptr + t)
    tile = tl.load(tiles_ptr + num_tiles + t)
    q_first = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # position of the row's first query
    r = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + r // HEADS_PER_TILE  # [M] query index within the row
    head = head_tile * HEADS_PER_TILE + r % HEADS_PER_TILE  # [M]
    row_ok = (r < BLOCK_Q * HEADS_PER_TILE) & (qi < q_len) & (head < NUM_HEADS)
    dl = tl.arange(0, L)
    dr = tl.arange(0, R)
    q_row = q_ptr + (q_first + qi)[:, None] * stride_qt + head[:, None] * stride_qh  # [M, 1]
    q_lat = tl.load(q_row + dl[None, :], mask=row_ok[:, None], other=0.0)  # [M, L]
    q_pe = tl.load(q_row + L + dr[None, :], mask=row_ok[:, None], other=0.0)  # [M, R]
    q_pos = ctx_start + qi  # [M]; padded rows sit past the tile and see every key it sees
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, L], 0.0, tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    first_pos = ctx_start + tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # keys the tile's last query sees
    full_end = first_pos // BLOCK_N * BLOCK_N  # keys every query of the tile sees
    # each tile's rows looked up one tile ahead, as in _decode_kernel (so that from 3 stages
    # the pipeliner keeps a tile of latents in flight during each tile's dots); the lookups
    # are masked at kv_end, so the unmasked loop's last lookahead reads no table entry past it
    row, valid = _tile_rows(table, 0, kv_end, L, R, BLOCK_SIZE, BLOCK_N)
    for n0 in range(0, full_end, BLOCK_N):
        row_next, valid_next = _tile_rows(table, n0 + BLOCK_N, kv_end, L, R, BLOCK_SIZE,
                                          BLOCK_N)
        acc, m_i, l_i = _attend_rows(q_lat, q_pe, acc, m_i, l_i, cache_ptr, row, valid,
                                     valid[None, :], scale_log2, L, R, False, IEEE)
        row, valid = row_next, valid_next
    row, valid = _tile_rows(table, full_end, kv_end, L, R, BLOCK_SIZE, BLOCK_N)
    for n0 in range(full_end, kv_end, BLOCK_N):
        row_next, valid_next = _tile_rows(table, n0 + BLOCK_N, kv_end, L, R, BLOCK_SIZE,
                                          BLOCK_N)
        pos = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
        acc, m_i, l_i = _attend_rows(q_lat, q_pe, acc, m_i, l_i, cache_ptr, row, valid, keep,
                                     scale_log2, L, R, True, IEEE)
        row, valid = row_next, valid_next
    o = acc / l_i[:, None]
    tl.store(out_ptr + (q_first + qi)[:, None] * stride_ot + head[:, None] * stride_oh
             + dl[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
