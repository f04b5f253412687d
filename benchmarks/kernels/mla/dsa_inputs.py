"""kernels_dsa's inputs: a decode or prefill step's indexer queries, weights and key cache over
blocks shuffled through one pool (`make_step`), and the absorbed queries with a latent cache
(`latent_inputs`), at GLM-5's indexer shape (HEADS x DIM) by default; `full_layer_step`, the
decode attention as a full DSA layer runs it."""

from __future__ import annotations

import numpy as np
import torch

from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata

HEADS, DIM = 32, 128  # GLM-5's lightning indexer: heads x head dim


def make_step(computed: list[int], scheduled: list[int], block: int, device: str,
              dtype: torch.dtype, integers: bool, seed: int = 0) -> tuple:
    """(q [T, H, D], w [T, H] fp32, index cache, metadata) over shuffled blocks."""
    rng = np.random.default_rng(seed)
    need = [-(-(c + s) // block) for c, s in zip(computed, scheduled)]
    free = rng.permutation(np.arange(1, sum(need) + 2)).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    meta = build_attention_metadata(computed, scheduled, tables, block, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape_q, shape_c = (meta.num_tokens, HEADS, DIM), (sum(need) + 2, block, DIM)
    if integers:
        q = torch.randint(-2, 3, shape_q, generator=gen, device=device).to(dtype)
        cache = torch.randint(-2, 3, shape_c, generator=gen, device=device).to(dtype)
        w = torch.randint(-2, 3, shape_q[:2], generator=gen, device=device) * 0.25
    else:
        q = torch.randn(shape_q, generator=gen, device=device).to(dtype)
        cache = torch.randn(shape_c, generator=gen, device=device).to(dtype)
        w = torch.randn(shape_q[:2], generator=gen, device=device) * HEADS ** -0.5
    return q, w.float(), cache, meta


def latent_inputs(n: int, num_blocks: int, seed: int, *, heads: int, width: int, block: int,
                  device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(absorbed queries [n, heads, width], a latent cache [num_blocks, block, width]),
    random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n, heads, width, generator=gen, device=device).to(dtype)
    return q, torch.randn(num_blocks, block, width, generator=gen, device=device).to(dtype)


def full_layer_step(q_i: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                    meta: AttentionMetadata, q: torch.Tensor, cache: torch.Tensor,
                    scale: float, mla_scale: float, latent: int, topk: int,
                    num_splits: int | None = None) -> torch.Tensor:
    """The indexer's selection, then the sparse MLA over it, as a full DSA layer runs them:
    its absorbed queries q made before the indexer's launches (triton_common's
    queries_made_earlier, under which the sparse MLA copies them before its PDL wait)."""
    from moeserve.kernels.attention.dsa import indexer_triton, sparse_triton
    from moeserve.kernels.triton_common import queries_made_earlier

    pos, _ = indexer_triton.indexer_topk_triton(q_i, w, index_cache, meta, scale, topk)
    with queries_made_earlier():
        return sparse_triton.dsa_attention_triton(q, cache, meta, pos, mla_scale, latent,
                                                  packed=True, num_splits=num_splits)
