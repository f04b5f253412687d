"""DeepSeek Sparse Attention (DSA), Triton path: the lightning indexer's scores and top-k over
the paged indexer-key cache; absorbed MLA over the selected positions is dsa/sparse_triton.py's
(the diagram shows both). The input checks both launchers share are here.

Same contracts as the torch references in kernels/attention/dsa/reference.py (`indexer_topk_ref`,
`dsa_attention_ref`); layers/dsa.py runs these when the MLA backend is the Triton one
(kernels/registry.py's DSA_BACKENDS). Triton is imported and the kernels jitted on first use
(`_kernels`), as in mla/absorbed_triton.py; on CPU in Triton's interpreter (TRITON_INTERPRET=1).

    indexer_topk_triton                                 dsa_attention_triton
      _index_score_kernel  grid (query tiles, key tiles)  _sparse_attention_kernel
        a tile: BLOCK_Q consecutive tokens of one row        grid (head tiles, tokens)
        (decode-only step: one token), each key tile         token t's selected positions,
        gathered by block table once for all of them:        BLOCK_N at a time, gathered through
        score = sum_h w[t,h] ReLU(q[t,h] . k[s] scale)      its row's block table ->
        -> one int32 ord(score) per (t, s), s <= p(t)       mla_triton._attend_rows (online
      topk_triton.radix_topk of the scores [T, S]           softmax, fp32) -> out [T, H, L]
        -> positions, ascending

Exact selection, ties included: the kernel writes for each context position ord(score), an
int32 of the fp32 score's order (its bits, the magnitude bits flipped for negatives; -0.0 first
made +0.0), and dsa/topk_triton.py's radix select takes the topk largest with ties to the
lowest position, as the reference's stable sort, returning them in ascending position order
(the reference's order too). Positions past the token's context are neither written nor read
(each token's context end comes from the metadata on the device). Scores equal the reference's
to fp32 rounding (dot and head sums in another order); a selection can differ only where two
scores are that close (see below for the tests' data).

Query tiles (index_block_q: 128 dot rows of tokens x heads, 4 tokens at GLM-5's 32 heads) share
each loaded key tile, so a prefill chunk of T tokens reads its context's keys T / BLOCK_Q times,
not T (the kernel's docstring has the bytes). A tile's scores are one [BLOCK_Q * H, D] x [D, N]
dot, then per query ReLU(. * scale) and the fp32 sum over its heads of w times that: the
reference's formula and fp32 operations, each score from its own query's row only (padded heads
and masked queries add exact zeros or are not stored). Only the order inside the dot's sum over
D and the head sum's tree are the compiler's, as in a one-token program (a taller dot may pick
another MMA), so scores agree with the reference to fp32 rounding and no further. The tests are
exact because their data is: random scores whose top-k + 1 are apart by far more than rounding
(tests/kernels/attention/test_dsa_triton_tiles.py checks that margin against fp64), or exact
scores (small integers: exact in any order; ReLU zeros; duplicated keys: identical operands
give identical sums), whose ties both break to the lowest position.

No host sync: a decode-only step (every host query length 1, also a CUDA graph's placeholder
ones) runs one token a program with every index read on the device (a token's row and position
from meta.token_to_req and meta.positions), the shapes from T, topk and meta.max_seq_len (as
the reference's decode path), so it can be captured in a CUDA graph. A step with a prefill row
(eager, its host lengths exact) cuts rows into query tiles on the host, copied once a step
(`meta.derived`, shared by its full layers); a decode row there is a tile of one. Long steps are
scored in chunks of whole tiles bounding the [n, S] key tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from moeserve.kernels.attention.checks import SUPPORTED_DTYPES
from moeserve.kernels.attention.dsa import topk_triton
from moeserve.kernels.attention.dsa.topk_bisect_triton import ROW_ALIGN
from moeserve.kernels.attention.metadata import AttentionMetadata, to_device
from moeserve.kernels.attention.mla import absorbed_triton as mla_triton
from moeserve.kernels.attention.paged import FP8_CACHE_DTYPES
from moeserve.kernels.triton_common import next_pow2, pdl_kwargs, require_attention_inputs_device

# int32 scores a chunk of tokens may hold ([n, S]): 128 MiB
_CHUNK_KEYS = 1 << 25
# rows (query tokens x indexer heads) of a prefill scoring program's q . k dot: see
# index_block_q (a [128, D] x [D, BLOCK_N] dot: fp32 accumulator [128, 64] at GLM-5's shape)
INDEX_TILE_ROWS = 128
# Key tiles a scoring program walks (its queries and weights loaded once for them). 8, as
# timed on the H200 (gpu_bb408cc/call1, against 1 / 2 / 4 / 16): the decode step in a graph
# 1-14% faster in all five kernels_dsa cases (b256 64k: 2.149 -> 1.841 ms), W3's prefill
# scores 13.09 -> 8.06 ms (16: 7.73); the tests also run 1 to 4.
score_key_tiles = 8
# The scoring launch's warps, and a decode-only step's pipeline stages (None: Triton's
# default, 3; a step with a prefill row always runs the default, untimed otherwise). 2 stages
# on decode steps: on an H100 in CUDA graphs (kernels_dsa's SCORE_LAUNCHES, five runs in
# gpu_48511b5 / gpu_6f54c80 / gpu_5c4e2c2 / gpu_2e525ad) the DSA step 0.1051-0.1122 ms against
# 0.1067-0.1129 at 32 x 8k, 0.5097-0.5311 against 0.5149-0.5357 at 256 x 8k, 0.3027 against
# 0.3094 at 32 x 64k: faster in all nine; 8 warps slower in all.
score_warps = 4
# (A form loading each next key tile into registers a tile ahead was compiled offline,
# kernel_sass index-score, and dropped untimed: Triton's pipeliner already streams the key
# tiles by cp.async, LDGSTS, at num_stages 3 with 80 registers; the register-staged form took
# 124 and plain loads. In git's history at d04b9d1.)
score_stages: int | None = 2

tl: Any = None  # triton.language, bound by _kernels(): the kernels below read it as a global
# mla_triton's jitted helper, bound by _kernels() too (the kernel reads it by global name)
_sum: Any = None


def scores_fp32(ords: torch.Tensor) -> torch.Tensor:
    """The scores index_score_chunks writes as ords (int32 of the fp32 order) back as fp32:
    the map is its own inverse (a negative's magnitude bits flipped back)."""
    return torch.where(ords < 0, ords ^ 0x7FFFFFFF, ords).view(torch.float32)


def index_block_n(head_dim: int) -> int:
    """Keys per scoring program: small at test dims, so the tile loop and its masks run."""
    return 16 if head_dim <= 64 else 64


def index_block_q(num_heads: int) -> int:
    """Query tokens per scoring program on a step with a prefill row: INDEX_TILE_ROWS dot rows
    of tokens x heads (heads padded to a power of two): GLM-5's 32 heads, 4 tokens; V3.2's
    64, 2; the tests' 8, 16. A decode-only step runs 1 (one token a program)."""
    return max(1, INDEX_TILE_ROWS // next_pow2(num_heads))


def indexer_topk_triton(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, topk: int,
                        count_boundary_ties: bool = False,
                        topk_chunk: int | None = None) -> tuple[torch.Tensor, int]:
    """Each query token's top-`topk` context positions by the indexer's score
    (`indexer_topk_ref`'s contract and result).

    Args:
        q: [T, H, D] the indexer's rotated queries (last dim contiguous), tokens in `meta`'s
            order; D a power of two >= 16.
        weights: [T, H] fp32 per-head weights (last dim contiguous).
        index_cache: [num_blocks, block_size, D], contiguous, q's dtype; the step's own keys
            already written.
        meta: the step's AttentionMetadata, its tensors on q's device.
        scale: D ** -0.5.
        count_boundary_ties: also count the queries whose k-th and (k+1)-th scores are equal
            (a host sync: tests only).
        topk_chunk: positions a top-k program takes (tests: small, so rows span several).
    Returns:
        (positions [T, topk] int32 in ascending position order, -1 after them where the
        context is shorter than topk; the number of boundary ties, 0 unless counted).
    """
    _check_indexer_inputs(q, weights, index_cache, meta, topk)
    num_tokens = q.shape[0]
    out = torch.empty(num_tokens, topk, dtype=torch.int32, device=q.device)  # all written
    ties = 0
    for t0, n, scores in index_score_chunks(q, weights, index_cache, meta, scale):
        ties += topk_triton.radix_topk(scores, meta, t0, topk, out[t0:t0 + n],
                                       chunk=topk_chunk,
                                       count_boundary_ties=count_boundary_ties)
    return out, ties


def index_score_chunks(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, block_q: int | None = None
                       ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The step's scores, a chunk of tokens at a time (indexer_topk_triton's inputs, checked
    there): (first token t0, tokens n, scores [n, S] int32 ord), S = max(1, meta.max_seq_len)
    rounded up to topk_bisect_triton.ROW_ALIGN (that top-k's vector loads; the columns past
    max_seq_len, like those past each token's context, are never written), each chunk
    launched as the previous one is consumed. block_q: tokens a tile on a step with
    a prefill row (benchmarks: 1 scores one token a program there); default index_block_q."""
    num_tokens, num_heads, dim = q.shape
    num_keys = -(-max(1, meta.max_seq_len) // ROW_ALIGN) * ROW_ALIGN
    if num_tokens == 0:
        return
    block_n = index_block_n(dim)
    chunk = max(1, _CHUNK_KEYS // num_keys)  # tokens a chunk: its [n, S] keys
    if bool((meta.query_lens_np == 1).all()):  # decode (or a graph's placeholder ones)
        block_q, tiles = 1, None  # program i: token t0 + i; every index read on the device
        chunks = [(t0, min(chunk, num_tokens - t0), None)
                  for t0 in range(0, num_tokens, chunk)]
    else:
        block_q = block_q or index_block_q(num_heads)
        key = ("indexer_topk_triton", block_q, chunk, q.device)
        if key not in meta.derived:  # the step's first full layer: later ones reuse it
            meta.derived[key] = _query_tiles(meta, block_q, chunk, q.device)
        tiles, chunks = meta.derived[key]
    kern = _kernels()
    for t0, n, part in chunks:
        scores = torch.empty(n, num_keys, dtype=torch.int32, device=q.device)  # [n, S]
        span = block_n * score_key_tiles
        grid = (n if part is None else part.stop - part.start, -(-num_keys // span))
        kern.index_score[grid](
            q, weights, index_cache, scores, meta.block_tables, meta.seq_lens, meta.positions,
            meta.token_to_req, meta.positions if part is None else tiles[part], scale, t0,
            num_keys, q.stride(0), q.stride(1), weights.stride(0), meta.block_tables.stride(0),
            NUM_HEADS=num_heads, BLOCK_H=max(16 // block_q, next_pow2(num_heads)),
            BLOCK_Q=block_q, D=dim, BLOCK_SIZE=index_cache.shape[1], BLOCK_N=block_n,
            USE_TILES=part is not None, IEEE=q.dtype == torch.float32,
            KEY_TILES=score_key_tiles, num_warps=score_warps, **pdl_kwargs(q.device),
            **({} if score_stages is None or part is not None else
               {"num_stages": score_stages}))
        yield t0, n, scores


def _query_tiles(meta: AttentionMetadata, block_q: int, chunk: int,
                 device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, slice]]]:
    """A step with a prefill row, from its exact host lengths: the query tiles, device int32
    [n_tiles, 2] = (first token, tokens), each row's tokens cut into tiles of block_q from its
    first (a decode row: one tile of one), in token order; and the chunks that score them,
    (first token, tokens, the chunk's slice of the tiles): whole tiles of at most `chunk`
    tokens, or one tile. One host-to-device copy."""
    q_lens = meta.query_lens_np
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    if int(cu[-1]) != meta.num_tokens:
        raise ValueError(f"indexer_topk_triton: meta's query lengths sum to {int(cu[-1])}, "
                         f"not its {meta.num_tokens} tokens")
    per_row = -(-q_lens // block_q)  # [B] tiles of each row
    row = np.repeat(np.arange(len(q_lens)), per_row)  # [n_tiles]
    within = np.arange(len(row)) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    first = cu[row] + within * block_q
    end = np.minimum(first + block_q, cu[row + 1])  # tiles cover the tokens in order
    chunks, a = [], 0
    while a < len(first):
        b = max(a + 1, int(np.searchsorted(end, first[a] + chunk, side="right")))
        chunks.append((int(first[a]), int(end[b - 1] - first[a]), slice(a, b)))
        a = b
    host = np.stack([first, end - first], axis=1).astype(np.int32)
    return to_device(host, device), chunks


# ---- input checks ----

def _need(who: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{who}: {what}")


def _pow2_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _check_common(who: str, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  cache_name: str, fp8_cache: bool = False) -> None:
    """The checks both launchers share: q and its cache's dtypes (fp8_cache: the cache may
    also be float8 e4m3, read back in q's dtype), devices, block size, the metadata's index
    tensors, and where Triton can run."""
    need = functools.partial(_need, who)
    need(q.dim() == 3, f"q must be [T, H, dim], got shape {tuple(q.shape)}")
    need(cache.dim() == 3,
         f"{cache_name} must be [num_blocks, block_size, dim], got {tuple(cache.shape)}")
    need(q.dtype in SUPPORTED_DTYPES, f"q dtype {q.dtype} not in {SUPPORTED_DTYPES}")
    allowed = (q.dtype, *FP8_CACHE_DTYPES) if fp8_cache else (q.dtype,)
    need(cache.dtype in allowed, f"{cache_name} dtype {cache.dtype} is not one of {allowed}")
    need(cache.device == q.device, f"{cache_name} on {cache.device}, q on {q.device}")
    need(q.shape[-1] == cache.shape[-1],
         f"q's last dim {q.shape[-1]} != {cache_name}'s {cache.shape[-1]}")
    need(meta.block_size == cache.shape[1],
         f"meta.block_size {meta.block_size} != {cache_name} block_size {cache.shape[1]}")
    need(q.stride(2) == 1, f"q's last dim must be contiguous, strides {q.stride()}")
    need(cache.is_contiguous(), f"{cache_name} must be contiguous")
    need(q.shape[0] == meta.num_tokens, f"q has {q.shape[0]} tokens, meta {meta.num_tokens}")
    for name, dtype in (("block_tables", torch.int32), ("seq_lens", torch.int32),
                        ("positions", torch.int64), ("token_to_req", torch.int64)):
        t = getattr(meta, name)
        need(t.dtype == dtype and t.is_contiguous(),
             f"meta.{name} must be contiguous {dtype}, got {t.dtype}")
        need(t.device == q.device, f"meta.{name} on {t.device}, q on {q.device}")
    require_attention_inputs_device(q, who)


def _check_indexer_inputs(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                          meta: AttentionMetadata, topk: int) -> None:
    """ValueError naming the first input the indexer kernel cannot take."""
    who = "indexer_topk_triton"
    need = functools.partial(_need, who)
    _check_common(who, q, index_cache, meta, "index_cache")
    need(_pow2_16(q.shape[-1]), f"index head dim {q.shape[-1]} must be a power of two >= 16")
    need(weights.dtype == torch.float32, f"weights must be fp32, got {weights.dtype}")
    need(weights.shape == q.shape[:2],
         f"weights must be [T, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    need(weights.device == q.device, f"weights on {weights.device}, q on {q.device}")
    need(weights.stride(1) == 1, f"weights' last dim must be contiguous, {weights.stride()}")
    need(topk >= 1, f"topk must be >= 1, got {topk}")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernels, once (interpreted if TRITON_INTERPRET=1 now). The
    shared helpers are mla_triton's, jitted there; the kernels read them and `tl` by global
    name, so they are bound here."""
    global tl, _sum, _key_tile
    import triton
    import triton.language

    mla_triton._kernels()
    tl = triton.language
    _sum = mla_triton._sum
    _key_tile = triton.jit(_key_tile)
    # NOTE: step-varying ints (the first token of a chunk, S, topk, the block table's width and
    # stride) and the query tiles sliced at any chunk's offset are exempt from specialisation:
    # a new batch shape must not compile a new variant mid-serving (see paged_triton._kernels).
    return SimpleNamespace(
        index_score=triton.jit(_index_score_kernel,
                               do_not_specialize=["t0", "num_keys", "stride_table"],
                               do_not_specialize_on_alignment=["tiles_ptr"]))


# ---- Triton kernels (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _key_tile(cache_ptr, table, n0, end, d, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """The keys [D, BLOCK_N] of context positions n0 .. n0 + BLOCK_N of a row (zeros from end):
    each position's block from the row's table, then its key row."""
    n = n0 + tl.arange(0, BLOCK_N)
    k_ok = n < end
    block = tl.load(table + n // BLOCK_SIZE, mask=k_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE  # [N]
    return tl.load(cache_ptr + slot[None, :] * D + d[:, None], mask=k_ok[None, :], other=0.0)


def _index_score_kernel(q_ptr, w_ptr, cache_ptr, keys_ptr, block_tables_ptr, seq_lens_ptr,
                        positions_ptr, token_to_req_ptr, tiles_ptr, scale, t0, num_keys,
                        stride_qt, stride_qh, stride_wt, stride_table,
                        NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
                        D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        USE_TILES: tl.constexpr, IEEE: tl.constexpr,
                        KEY_TILES: tl.constexpr, PDL: tl.constexpr):
    """Program (i, span): the scores' ord [BLOCK_Q, BLOCK_N] of query tile i over KEY_TILES
    key tiles of BLOCK_N context positions from span * BLOCK_N * KEY_TILES, written to keys
    rows (token - t0) ([n, num_keys] int32) where each query sees the position (the rest of
    the row is left as it was); the queries and weights loaded once for the span's tiles.

    Query tile i: USE_TILES, tiles row i = (first token, count <= BLOCK_Q), consecutive tokens
    of one row; else the one token t0 + i (BLOCK_Q 1: decode, every index on the device). Dot
    rows r = query * BLOCK_H + head (heads padded to BLOCK_H, BLOCK_Q * BLOCK_H >= 16): one
    [BLOCK_Q * BLOCK_H, D] x [D, BLOCK_N] dot per loaded key tile, then per query the
    reference's ReLU(q . k * scale) and fp32 sum of w * that over its heads; query j masks
    positions past its own (s <= its position, s < the row's seq_len).

    Reads per program: one key tile, BLOCK_N x D x the cache's bytes, for BLOCK_Q tokens, and
    those tokens' q rows [BLOCK_Q * Hi, D] and weights. Keys per query token, bf16, GLM-5's
    Hi = 32, D = 128, BLOCK_N = 64, a prefill chunk of T = 64 tokens of one request whose
    tokens each see about S positions (a chunk after S - 64; causal, so S - 63 .. S):
      before (one token a program): each token loads every key tile it sees, D * 2 = 256 B a
        key: 256 * S a token, 64 * 256 * S = 16 KiB * S for the chunk;
      now (BLOCK_Q = INDEX_TILE_ROWS // 32 = 4 tokens a program): 256 / 4 = 64 B a key a
        token, 64 * S a token, 64 / 4 = 16 tiles * 256 * S = 4 KiB * S for the chunk;
      S = 8192: 2 MiB -> 512 KiB a token, 128 MiB -> 32 MiB the chunk.
    q is loaded per key tile as before: Hi * D * 2 = 8 KiB a token per 64 keys, 128 B a key a
    token (the chunk's q, 64 * 8 KiB = 512 KiB, stays in L2). Decode rows: one token, 256 B a
    key, as before. PDL (a level, triton_common.pdl): launched early, it first waits for the
    previous kernel (2: then lets its successor launch; 3: both once it has read its tile's
    metadata).
    """
    if PDL == 1 or PDL == 2:  # at the top; 3: once the step's metadata below is read
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    span0 = tl.program_id(1) * (BLOCK_N * KEY_TILES)
    if USE_TILES:
        first = tl.load(tiles_ptr + 2 * i).to(tl.int64)
        count = tl.load(tiles_ptr + 2 * i + 1)
    else:
        first = (t0 + i).to(tl.int64)
        count = 1
    req = tl.load(token_to_req_ptr + first)
    seq_len = tl.load(seq_lens_ptr + req)
    qi = tl.arange(0, BLOCK_Q)  # [Q] query within the tile
    q_ok = qi < count
    tok = first + qi  # [Q]
    # keys each query sees: s <= its position, s < its row's seq_len (padding rows: maybe none);
    # the tile's last query sees the most (positions rise along a row)
    kv_end = tl.minimum(tl.load(positions_ptr + tok, mask=q_ok, other=-1) + 1, seq_len)  # [Q]
    kv_hi = tl.minimum(tl.load(positions_ptr + first + count - 1) + 1, seq_len)
    if PDL == 3:  # the metadata read: now the previous kernel's outputs (triton_common.pdl)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if span0 < kv_hi:  # causal: key tiles wholly after the tile's last query write nothing
        r = tl.arange(0, BLOCK_Q * BLOCK_H)  # [M] dot rows
        r_ok = (r // BLOCK_H < count) & (r % BLOCK_H < NUM_HEADS)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (first + r // BLOCK_H)[:, None] * stride_qt
                    + (r % BLOCK_H)[:, None] * stride_qh + d[None, :],
                    mask=r_ok[:, None], other=0.0)  # [M, D], once for the program's tiles
        h = tl.arange(0, BLOCK_H)
        w = tl.load(w_ptr + tok[:, None] * stride_wt + h[None, :],
                    mask=q_ok[:, None] & (h < NUM_HEADS)[None, :], other=0.0)  # [Q, H'] fp32
        table = block_tables_ptr + req * stride_table
        span_end = tl.minimum(span0 + BLOCK_N * KEY_TILES, kv_hi)
        for n0 in range(span0, span_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)  # [N] context positions
            k = _key_tile(cache_ptr, table, n0, kv_hi, d, D, BLOCK_SIZE, BLOCK_N)  # [D, N]
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)  # [M, N] fp32 accumulation of exact half products
            s = tl.maximum(s * scale, 0.0)  # the reference's order: q . k, times scale, ReLU
            s = tl.reshape(s, [BLOCK_Q, BLOCK_H, BLOCK_N])
            score = _sum(s * w[:, :, None], 1)  # [Q, N]; padded heads add w 0 x 0
            score = tl.where(score == 0.0, 0.0, score)  # -0.0 must tie +0.0 (the ref's ==)
            bits = score.to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order = fp32 order
            # each query's own context only (kv_end <= seq_len <= num_keys): the top-k reads no
            # further, so a CUDA graph's bound past the contexts costs no writes
            tl.store(keys_ptr + (tok - t0)[:, None] * num_keys + n[None, :], ordered,
                     mask=q_ok[:, None] & (n[None, :] < kv_end[:, None]))
