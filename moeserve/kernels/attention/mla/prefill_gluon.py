"""The absorbed MLA prefill on decode_gluon's kernel (its PREFILL form, Hopper's wgmma):
`prefill_gluon`, absorbed_triton._launch_prefill's contract. A program's 64 query rows are
`prefill_block_q` of a row's tokens x a tile of heads (20 heads: 3 tokens x 20; 64 or more: one
token), each row masked to its token's causal context; grid (query tiles, head tiles).

On the H200 1.07-1.9x the Triton prefill in all 24 kernels_mla_prefill cases
(benchmarks/results/gpu_5bd5ebf/call6-7); the Triton launcher runs it wherever
decode_gluon.supports holds (MOESERVE_MLA_PREFILL_GLUON=0: not).
"""

from __future__ import annotations

import math

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla import decode_gluon


def prefill_block_q(num_heads: int) -> tuple[int, int, int]:
    """(head tiles, heads a tile, query tokens a tile) of `prefill_gluon`: the heads in tiles
    of at most 64, balanced, and as many of a row's tokens as fill the 64 query rows beside
    a tile of heads (20 heads: 3 tokens; 64 or more: 1)."""
    num_tiles = -(-num_heads // decode_gluon.BLOCK_H)
    per_tile = -(-num_heads // num_tiles)
    return num_tiles, per_tile, decode_gluon.BLOCK_H // per_tile


def prefill_gluon(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, kv_lora_rank: int, out: torch.Tensor, tiles: torch.Tensor,
                  num_tiles: int, block_n: int | None = None,
                  stages: int | None = None) -> None:
    """Absorbed MLA prefill rows by query tile, absorbed_triton._launch_prefill's contract:
    `tiles` [2 * num_tiles] int32 (the row of each tile, then its index within the row), a
    tile being `prefill_block_q(H)[2]` of the row's tokens; each token's queries over its
    causal context (the cached positions before the row's query, and the query up to it),
    written to out [T, H, L]."""
    block_n, stages = decode_gluon.tile(block_n, stages, False)
    decode_gluon._check(q, latent_cache, kv_lora_rank, stages, False)
    if num_tiles == 0:
        return
    num_heads, dim = q.shape[1:]
    num_head_tiles, per_tile, block_q = prefill_block_q(num_heads)
    decode_gluon._kernels().decode[(num_tiles, num_head_tiles, 1)](
        q, latent_cache, out, out, out, out, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, tiles, meta.seq_lens, meta.token_to_req, meta.positions,
        scale * math.log2(math.e), 0, 1, num_tiles, meta.block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0), 0,
        NUM_HEADS=num_heads, L=kv_lora_rank, R=dim - kv_lora_rank,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_N=block_n, STAGES=stages, USE_ROWS=True,
        SPLIT=False, OVERLAP=False, SPARSE=False, PACKED=False, PREFILL=True, HPT=per_tile,
        BLOCK_Q=block_q, VEC_STORE=False, SLOTS=False,
        num_warps=decode_gluon.NUM_WARPS)
