"""Paged attention, Triton path: GQA decode (split-K for long contexts) and prefill kernels.

Same contract as `paged_attention_ref` (kernels/attention/paged.py): causal attention of each
row's new tokens over its whole paged context; the step's own K/V are already in the cache.
Registered as the "triton" attention backend. Triton is imported and the kernels jitted on first
use (`_kernels`), so importing this module needs no triton. On CPU they run in Triton's
interpreter: TRITON_INTERPRET=1 must be set before that first use (the kernels avoid
triton.language's own jitted helpers, so triton itself may have been imported earlier).

    q [T, H, D] ----host split on meta.query_lens_np----+
      decode rows (query_len == 1)                       |  prefill rows (chunks, prefix hits)
      _decode_kernel  grid (rows, KVH, splits)           |  _prefill_kernel  grid (tiles, KVH)
        one program = all G = H // KVH query heads       |    one program = BLOCK_Q tokens x G
        of one KV head over one context partition:       |    heads of one KV head; loops over
        each K/V tile is read once for the group         |    the paged context, causal masking
      splits > 1: partial (max, sum, acc) in fp32 ->     |    on the tiles past the first query
        _decode_reduce_kernel  grid (rows, H)            |
    out [T, H, D] <--------------------------------------+

A float8 e4m3 cache (kv_cache_dtype="fp8") is read back in q's dtype as each tile loads.
Keys are gathered token by token through the block table (slot = block * block_size + offset),
so a tile of BLOCK_N keys may span several KV blocks. Softmax is online, in fp32 and base 2.
Pure decode steps build no host tensors and never sync: CUDA-graph capturable. The split count is
fixed at launch from (rows, KVH, meta.max_seq_len) and the last partition always runs to the
row's seq_len, so a graph captured at a shorter max_seq_len still attends every key (less split).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from moeserve import envs
from moeserve.kernels.attention.checks import (
    check_cache_and_step,
    needer,
)
from moeserve.kernels.attention.limits import paged_triton_unfit
from moeserve.kernels.attention.metadata import AttentionMetadata, to_device
from moeserve.kernels.attention.metadata import longest_first as longest_first_rows
from moeserve.kernels.triton_common import next_pow2

# split-K: aim for this many decode programs (~8 per SM on an H200's 132), partitions >= this many
TARGET_DECODE_PROGRAMS = 1024
MIN_PARTITION_TOKENS = 256
MAX_SPLITS = 64
# the decode's rows launched longest context first (metadata.longest_first; the switch
# MOESERVE_DECODE_LONGEST_FIRST=1): off, W1 qwen3-30b-a3b c1024 9,399 against 9,377 tok/s with
# it (H100, gpu_8267862/call5); the MLA decode's is on (decode_gluon.longest_first)
longest_first = envs.decode_longest_first(default=False)
# a prefill with a query chunk this long takes the long-prompt tile (default_config); W1's sweep
# had (64, 32, 4, 2) fastest up to 8 fresh prompts of 1,024 tokens
LONG_PREFILL_MIN_TOKENS = 2048

tl: Any = None  # triton.language, bound by _kernels(): the kernels below read it as a global


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one kernel. block_m: prefill query rows per program (tokens x the query
    heads of one KV head), unused by decode; block_n: keys per loop iteration; maxnreg: a cap
    on each thread's registers (Triton's launch option; None: the compiler's choice), so that
    more programs fit an SM (MLA's decode: two at 8 warps under 128)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if self.block_n not in (16, 32, 64, 128, 256):
            raise ValueError(f"TileConfig.block_n {self.block_n} not in (16, 32, 64, 128, 256)")
        if self.block_m < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"bad TileConfig {self}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"TileConfig.maxnreg {self.maxnreg} not in 24..255")

    def launch(self) -> dict[str, int]:
        """The Triton launch options: warps, stages and, when set, the register cap."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


def default_config(kind: str, head_dim: int, dtype: torch.dtype,
                   longest_query: int = 0) -> TileConfig:
    """Defaults for kind "decode" or "prefill" (benchmarks/kernels/kernels_attention.py sweeps);
    a prefill whose longest query chunk is at least LONG_PREFILL_MIN_TOKENS gets the tile
    measured best for long prompts."""
    if head_dim <= 32:  # tiny test shapes: small tiles, so loops and masks run several times
        return TileConfig(32, 16, 2, 1)
    if kind == "decode":
        return TileConfig(16, 32 if head_dim > 128 or dtype == torch.float32 else 64, 4, 2)
    # long prompts at head_dim 128, bf16, on the H200 (kernels_attention --prefill-cases long at
    # 40dfc12, 44 tiles): (128, 64, 4, 3) was the fastest in both cases, a fresh 8,192-token
    # prompt 1.301 ms a layer (53.7% of the bf16 peak) against 1.437 with (64, 32, 4, 2), four
    # last 2,048-token chunks of 8k prompts 2.107 against 2.441 (58.0%)
    if longest_query >= LONG_PREFILL_MIN_TOKENS and head_dim == 128 and dtype != torch.float32:
        return TileConfig(128, 64, 4, 3)
    # prefill at head_dim 128, bf16, on the H200 (kernels_attention's prefill sweep at 8feec63):
    # (64, 32, 4, 2) was the fastest of 44 tiles in all three cases, W1's 64 fresh prompts of
    # 128 tokens 0.072 ms a layer against 0.117 with the earlier (128, 64, 8, 2), 8 x 1,024 fresh
    # 0.226 against 0.276, 8 x 512 after 512 cached 0.168 against 0.205
    if dtype == torch.float32 or head_dim >= 128:
        return TileConfig(64, 32, 4, 2)
    return TileConfig(128, 64, 4, 2)  # head_dim 33-127: not measured


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Context partitions per decode row: enough programs to fill the GPU, none shorter than
    MIN_PARTITION_TOKENS, so short contexts and large batches run in one pass."""
    by_length = -(-max_seq_len // MIN_PARTITION_TOKENS)
    by_programs = -(-TARGET_DECODE_PROGRAMS // max(1, num_rows * num_kv_heads))
    return max(1, min(by_length, by_programs, MAX_SPLITS))


def paged_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, *, decode_splits: int | None = None,
                           decode_config: TileConfig | None = None,
                           prefill_config: TileConfig | None = None) -> torch.Tensor:
    """Causal attention of each row's new tokens over its paged context (see the module doc).

    Args:
        q: [T, H, D] (last dim contiguous), tokens in the order of `meta`.
        kv_cache: [2, num_blocks, block_size, KVH, D], contiguous, q's dtype.
        meta: the step's AttentionMetadata; its int32 tensors on q's device.
        scale: softmax scale.
        decode_splits: force the decode split count (tests, CUDA-graph capture); default
            `decode_num_splits`.
        decode_config, prefill_config: tile shapes (benchmarks); default `default_config`.
    Returns:
        [T, H, D] contiguous, q's dtype.
    """
    _check_inputs(q, kv_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    if q.shape[0] == 0:
        return out
    is_decode = meta.query_lens_np == 1  # [B]
    if bool(is_decode.all()):  # every index already on the device: no host work, no sync
        _launch_decode(q, kv_cache, meta, scale, out, None, meta.num_reqs, meta.max_seq_len,
                       decode_splits, decode_config)
        return out
    prefill_cfg = prefill_config or default_config(
        "prefill", q.shape[2], q.dtype, int(meta.query_lens_np.max()))
    block_q = _prefill_block_q(prefill_cfg, q.shape[1] // kv_cache.shape[3])
    key = ("paged_attention_triton", block_q, q.device)
    if key not in meta.derived:  # the step's first layer: later layers reuse it
        meta.derived[key] = _split_rows(meta, is_decode, block_q, q.device)
    dev, num_decode, num_tiles, max_seq = meta.derived[key]
    if num_decode:
        _launch_decode(q, kv_cache, meta, scale, out, dev[:num_decode], num_decode, max_seq,
                       decode_splits, decode_config)
    _launch_prefill(q, kv_cache, meta, scale, out, dev[num_decode:], num_tiles, prefill_cfg)
    return out


def _split_rows(meta: AttentionMetadata, is_decode: np.ndarray, block_q: int,
                device: torch.device) -> tuple[torch.Tensor, int, int, int]:
    """A mixed step's rows: (device int32 [decode rows | tile rows | tile indices], number of
    decode rows, number of prefill query tiles, longest decode context), in one copy."""
    decode_rows = np.flatnonzero(is_decode)  # [Bd]
    prefill_rows = np.flatnonzero(~is_decode)  # [Bp]
    tiles_per_row = -(-meta.query_lens_np[prefill_rows] // block_q)  # [Bp]
    tile_req = np.repeat(prefill_rows, tiles_per_row)  # [n_tiles] row of each query tile
    first_tile = np.cumsum(tiles_per_row) - tiles_per_row  # [Bp]
    # each row's tiles last first: a causal tile's work grows with its index, so the longest
    # start first and the grid's tail is short ones (longest-processing-time order)
    tile_idx = (np.repeat(first_tile + tiles_per_row, tiles_per_row) - 1
                - np.arange(len(tile_req)))  # [n_tiles]
    host = np.concatenate([decode_rows, tile_req, tile_idx]).astype(np.int32)
    max_seq = int(meta.seq_lens_np[decode_rows].max()) if len(decode_rows) else 0
    return to_device(host, device), len(decode_rows), len(tile_req), max_seq


def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """ValueError naming the first input the kernels cannot take."""
    who = "paged_attention_triton"
    need = needer(who)
    need(q.dim() == 3, f"q must be [T, H, D], got shape {tuple(q.shape)}")
    need(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
         f"kv_cache must be [2, num_blocks, block_size, KVH, D], got {tuple(kv_cache.shape)}")
    num_heads, head_dim = q.shape[1:]
    _, _, block_size, num_kv_heads, kv_dim = kv_cache.shape
    need(head_dim == kv_dim, f"q head_dim {head_dim} != kv_cache head_dim {kv_dim}")
    unfit = paged_triton_unfit(head_dim)  # the rule the engine config chose the backend by
    need(unfit is None, unfit or "")
    need(num_heads % num_kv_heads == 0,
         f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_cache_and_step(who, q, kv_cache, "kv_cache", block_size, meta)


def _prefill_block_q(cfg: TileConfig, group: int) -> int:
    """Query tokens per prefill program: block_m rows hold block_q tokens x group heads."""
    return max(1, cfg.block_m // group)




def _launch_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor, rows: torch.Tensor | None, num_rows: int,
                   max_seq_len: int, num_splits: int | None,
                   cfg: TileConfig | None = None) -> None:
    """Decode rows (one query each): `rows` [num_rows] int32 row ids, or None for rows 0..B-1."""
    kern = _kernels()
    if longest_first and num_rows > 1:  # the same rows, another launch order
        rows = longest_first_rows(meta, rows)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    cfg = cfg or default_config("decode", head_dim, q.dtype)
    if num_splits is None:
        num_splits = decode_num_splits(num_rows, num_kv_heads, max_seq_len)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_attention_triton: decode_splits must be in 1..{MAX_SPLITS}, "
                         f"got {num_splits}")
    partition = -(-max(1, max_seq_len) // num_splits)
    partition = -(-partition // cfg.block_n) * cfg.block_n  # whole key tiles per partition
    split = num_splits > 1
    if split:
        part_m = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32,
                             device=q.device)  # [n, H, S] running max (base-2 logits)
        part_l = torch.empty_like(part_m)  # [n, H, S] sum of exp2
        part_acc = torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)  # [n, H, S, D] unnormalised output
    else:
        part_m = part_l = part_acc = out  # unused
    row_ids = rows if rows is not None else meta.query_start_loc  # unused when USE_ROWS is off
    kern.decode[(num_rows, num_kv_heads, num_splits)](
        q, kv_cache[0], kv_cache[1], out, part_m, part_l, part_acc,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, row_ids,
        scale * math.log2(math.e), partition, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n,
        USE_ROWS=rows is not None, SPLIT=split, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        kern.decode_reduce[(num_rows, num_heads)](
            part_m, part_l, part_acc, out, meta.query_start_loc, row_ids, num_splits,
            out.stride(0), out.stride(1),
            # one BLOCK_S for every split count: one compiled variant, not one per power of two
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_S=next_pow2(max(2, MAX_SPLITS)),
            USE_ROWS=rows is not None, num_warps=4)


def _launch_prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor, tiles: torch.Tensor, num_tiles: int,
                    cfg: TileConfig) -> None:
    """Prefill rows by query tile: `tiles` [2 * num_tiles] int32 = (row of each tile, tile index
    within the row)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    block_q = _prefill_block_q(cfg, group)
    _kernels().prefill[(num_tiles, num_kv_heads)](
        q, kv_cache[0], kv_cache[1], out, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, tiles, num_tiles, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=max(16, next_pow2(block_q * group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now). Kernels
    call the helpers and read `tl` by global name (Triton resolves names in the module's
    globals), so those are bound here."""
    global tl, _attend_tile, _max, _sum
    import triton
    import triton.language

    tl = triton.language
    _max, _sum = triton.jit(_max), triton.jit(_sum)
    _attend_tile = triton.jit(_attend_tile)
    # NOTE: Triton compiles a variant per "is this int a multiple of 16 / equal to 1" and per
    # pointer alignment of every argument; sizes that change from step to step (row counts, the
    # block table's width, index arrays sliced at any offset) would compile new variants in the
    # middle of serving (seconds each: 7.6 s of a 31 s W1 run on the H200). They are exempt.
    return SimpleNamespace(
        decode=triton.jit(_decode_kernel,
                          do_not_specialize=["partition", "num_splits", "stride_table"],
                          do_not_specialize_on_alignment=["rows_ptr"]),
        decode_reduce=triton.jit(_decode_reduce_kernel, do_not_specialize=["num_splits"],
                                 do_not_specialize_on_alignment=["rows_ptr"]),
        prefill=triton.jit(_prefill_kernel, do_not_specialize=["num_tiles", "stride_table"],
                           do_not_specialize_on_alignment=["tiles_ptr"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _max(x, AXIS: tl.constexpr):
    """Max over AXIS of fp32 x, as tl.max but without its own jit wrapper: the same IR, and it
    also runs in the interpreter when triton was imported before TRITON_INTERPRET=1 was set
    (tl.max is then a compiled-mode function; the interpreter recognises the combine fn)."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


def _sum(x, AXIS: tl.constexpr):
    """Sum over AXIS of fp32 x (see _max)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, n0, kv_end, q_pos, kv_head,
                 scale_log2, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step of rows q [M, D] over keys n0 .. n0 + BLOCK_N of one row's paged
    context. MASKED: keys >= kv_end (and, CAUSAL, keys after q_pos [M]) are dropped."""
    pos = n0 + tl.arange(0, BLOCK_N)  # [N] key positions
    d = tl.arange(0, HEAD_DIM)  # [D]
    if MASKED:
        valid = pos < kv_end  # [N]
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    else:
        block = tl.load(table_ptr + pos // BLOCK_SIZE)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [N]
    offs = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM  # [N]
    if MASKED:
        k = tl.load(k_ptr + offs[None, :] + d[:, None], mask=valid[None, :], other=0.0)
    else:
        k = tl.load(k_ptr + offs[None, :] + d[:, None])  # [D, N]
    k = k.to(q.dtype)  # a float8 cache read back in the query's dtype (else no-op)
    # fp32: exact products (the reference's precision); half types: default tensor-core dots.
    # Two branches, not input_precision=None: a constexpr None would not select the default.
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee") * scale_log2  # [M, N] base-2 logits
    else:
        s = tl.dot(q, k) * scale_log2
    if MASKED:
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (pos[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, _max(s, 1))  # [M]; finite: every row sees a key in its 1st tile
    alpha = tl.exp2(m_i - m_new)  # [M]
    p = tl.exp2(s - m_new[:, None])  # [M, N]
    l_i = l_i * alpha + _sum(p, 1)
    if MASKED:
        v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + offs[:, None] + d[None, :])  # [N, D]
    v = v.to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                   block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, rows_ptr,
                   scale_log2, partition, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_ROWS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """Program (i, kv_head, split): the GROUP query heads of kv_head for decode row i, over
    context partition `split` (the last one runs to seq_len)."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    tok = tl.load(query_start_loc_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * partition
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(seq_len, start + partition))
    g = tl.arange(0, BLOCK_G)  # [G] query head within the group (padded)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)  # [G, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, end, end,
                                     kv_head, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, False, False, IEEE)
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, end, end,
                                     kv_head, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, True, False, IEEE)
    if SPLIT:
        part = (i * (NUM_KV_HEADS * GROUP) + head) * num_splits + split  # [G]
        tl.store(part_m_ptr + part, m_i, mask=g_ok)
        tl.store(part_l_ptr + part, l_i, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty row (seq_len 0 padding) writes 0
        o = acc / l_safe[:, None]
        tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def _decode_reduce_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, query_start_loc_ptr,
                          rows_ptr, num_splits, stride_ot, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_S: tl.constexpr, USE_ROWS: tl.constexpr):
    """Program (i, head): combine the split partials of decode row i, query head `head`."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    if USE_ROWS:
        req = tl.load(rows_ptr + i)
    else:
        req = i
    tok = tl.load(query_start_loc_ptr + req)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_ok = s < num_splits
    base = (i * NUM_HEADS + head) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))  # [S]
    l_s = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)  # [S]
    m_max = _max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [S]; empty partitions (max -inf) weigh 0
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None], other=0.0)  # [S, D]
    total = _sum(w * l_s, 0)
    total = tl.where(total == 0.0, 1.0, total)
    o = _sum(acc * w[:, None], 0) / total  # [D]
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_loc_ptr, tiles_ptr, num_tiles, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (t, kv_head): query tile t (BLOCK_Q tokens of one row) x the GROUP query heads of
    kv_head, flattened to rows r = token * GROUP + head; causal over the row's paged context."""
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tiles_ptr + t)
    tile = tl.load(tiles_ptr + num_tiles + t)
    q_first = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # position of the row's first query
    r = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + r // GROUP  # [M] query index within the row
    head = kv_head * GROUP + r % GROUP  # [M]
    row_ok = (r < BLOCK_Q * GROUP) & (qi < q_len)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_first + qi)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=row_ok[:, None], other=0.0)  # [M, D]
    q_pos = ctx_start + qi  # [M]; padded rows sit past seq_len and see every key
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_table
    first_pos = ctx_start + tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # keys the tile's last query sees
    full_end = first_pos // BLOCK_N * BLOCK_N  # keys every query of the tile sees
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, kv_end, q_pos,
                                     kv_head, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, False, False, IEEE)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, kv_end, q_pos,
                                     kv_head, scale_log2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                     BLOCK_N, True, True, IEEE)
    o = acc / l_i[:, None]
    tl.store(out_ptr + (q_first + qi)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
