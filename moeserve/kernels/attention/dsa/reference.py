"""DeepSeek Sparse Attention (DSA), torch references: the lightning indexer's scores and top-k
over the paged indexer-key cache, and MLA over the selected positions.

The indexer key cache of a full layer is paged like the latent cache (the same blocks and
slots, one more tensor):

    index_cache: [num_blocks, block_size, index_head_dim]   slot s -> index_cache.view(-1, D)[s]

Selection (`indexer_topk_ref`), for a query token t of row b at position p and each context
position s <= p of that row (s < seq_lens[b]):

    score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s] * scale)        fp32, h < index_n_heads
    selected(t) = the `topk` positions of highest score; ties to the LOWEST position
                  (a stable sort); a context of at most `topk` positions selects all of them

returned as positions [T, topk] int32, in ascending position order, -1 after them when the
context is shorter than topk (the order the Triton top-k writes, and the sparse attention's
cache reads run in). The order of operations is transformers' (q . k in fp32 times scale,
ReLU, then the weighted sum over heads as one matmul), so scores agree to rounding.

transformers takes `torch.topk` of the masked scores, whose choice among equal scores is
implementation-defined (CPU: std::partial_sort or nth_element over the whole masked row; a
different answer with more masked keys after the context, i.e. with another chunking, and on
CUDA): equal scores at the k-th place happen when ReLU zeroes every head for several keys.
Here ties break to the lowest position in every path; `count_boundary_ties` tells whether any
selection had a tie at its k-th place (tests use it: without one, both agree exactly).

Sparse attention (`dsa_attention_ref`): the absorbed MLA form (mla/reference.py) over
the selected rows only: scores [T, H, topk], softmax in fp32, the latents as values.

Neither function syncs with the device when every row is a decode (their gathers and the
sort have static shapes given T, topk and meta.max_seq_len), so a decode step can be
captured. Their Triton kernels, with the same contracts, are in dsa/indexer_triton.py (the "triton"
attention backend runs them for DSA models).
"""

from __future__ import annotations

import numpy as np
import torch

from moeserve.kernels.attention.metadata import AttentionMetadata, to_device
from moeserve.kernels.attention.paged import context_slots

# fp32 elements a chunk of the references may hold in its largest temporary ([n, Q, H, S]
# scores, [T, topk, L + R] gathered latents): 256 MiB
_CHUNK_ELEMS = 1 << 26


def write_index_keys(keys: torch.Tensor, index_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Write the step's [T, D] indexer keys (the cache's dtype) into their slots, in place
    (padding tokens may share the null block's slots)."""
    index_cache.view(-1, index_cache.shape[-1]).index_copy_(0, slot_mapping, keys)


def indexer_topk_ref(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, topk: int,
                     count_boundary_ties: bool = False) -> tuple[torch.Tensor, int]:
    """Each query token's top-`topk` context positions by the indexer's score.

    Args:
        q: [T, H, D] the indexer's rotated queries (tokens in `meta`'s order).
        weights: [T, H] fp32 per-head weights (weights_proj(x) * H ** -0.5).
        index_cache: [num_blocks, block_size, D], the step's own keys already written.
        scale: D ** -0.5.
        count_boundary_ties: also count the queries whose k-th and (k+1)-th scores are equal
            (a host sync: tests only).
    Returns:
        (positions [T, topk] int32, -1 where the context is shorter than topk; the number of
        boundary ties, 0 unless counted).
    """
    assert meta.block_size == index_cache.shape[1], (meta.block_size, index_cache.shape)
    num_tokens, heads = q.shape[:2]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    ties = 0
    if num_tokens == 0:
        return out, ties
    query_lens = meta.query_lens_np
    if bool((query_lens == 1).all()):  # pure decode: device indices only
        seq = meta.seq_lens.long()
        groups = [(None, meta.block_tables, seq, seq - 1, 1, meta.max_seq_len)]
    else:
        groups = _host_groups(meta, q.device)
    for tok, tables, seq, start, q_len, max_seq in groups:
        rows = tables.shape[0]
        q_grp = (q if tok is None else q[tok]).reshape(rows, q_len, heads, -1)
        w_grp = (weights if tok is None else weights[tok]).reshape(rows, q_len, heads)
        # chunks bound the [rows, queries, H, S] scores: rows of decodes, or one row's queries
        step = max(1, _CHUNK_ELEMS // (heads * max(max_seq, 1)))
        for r0 in range(0, rows, max(1, step // q_len)):
            r = slice(r0, r0 + max(1, step // q_len))
            for q0 in range(0, q_len, step):
                qs = slice(q0, q0 + step)
                pos, n_ties = _score_topk(q_grp[r, qs], w_grp[r, qs], index_cache, tables[r],
                                          seq[r], start[r] + q0, max_seq, scale, topk,
                                          count_boundary_ties)
                ties += n_ties
                # tokens of this chunk: rows r, queries qs (row-major in the group)
                idx = (torch.arange(r0, r0 + pos.shape[0], device=q.device)[:, None] * q_len
                       + torch.arange(q0, q0 + pos.shape[1], device=q.device)[None, :])
                idx = idx.reshape(-1)
                out[idx if tok is None else tok[idx]] = pos.reshape(-1, topk)
    return out, ties


def _host_groups(meta: AttentionMetadata, device: torch.device) -> list[tuple]:
    """The step's rows as groups the references can pad: all decode rows together, then each
    other row alone (its own query count and context). Each group: (token indices [n * Q] in
    the step, block tables [n, max_blocks], seq_lens [n], start [n], Q, max_seq_len)."""
    query_lens, seq_lens = meta.query_lens_np, meta.seq_lens_np
    cu = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    groups = []
    decode = np.flatnonzero(query_lens == 1)
    if len(decode):
        groups.append((decode, cu[decode], 1))
    groups += [(np.array([b]), np.arange(cu[b], cu[b + 1]), int(query_lens[b]))
                for b in np.flatnonzero(query_lens != 1)]
    out = []
    for rows, tok, q_len in groups:
        rows_t = to_device(rows, device)
        seq = to_device(seq_lens[rows], device)
        out.append((to_device(np.asarray(tok, dtype=np.int64), device),
                    meta.block_tables[rows_t], seq, seq - q_len, q_len,
                    int(seq_lens[rows].max())))
    return out


def _score_topk(q: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                tables: torch.Tensor, seq: torch.Tensor, start: torch.Tensor, max_seq: int,
                scale: float, topk: int, count_ties: bool) -> tuple[torch.Tensor, int]:
    """q [n, Q, H, D], w [n, Q, H] -> positions [n, Q, topk] int32 (see indexer_topk_ref).
    Query i of row j sits at position start[j] + i."""
    n, num_q = q.shape[:2]
    slots, mask = context_slots(tables, seq, start, max_seq, index_cache.shape[1], num_q)
    keys = index_cache.view(-1, index_cache.shape[-1])[slots]  # [n, S, D]
    # transformers' order: fp32 q . k times scale, ReLU, then sum_h w_h x as one matmul
    scores = torch.matmul(q.float(), keys.float().transpose(1, 2)[:, None]) * scale
    scores = torch.relu(scores)  # [n, Q, H, S]
    index = torch.matmul(w.float()[:, :, None, :], scores)[:, :, 0]  # [n, Q, S]
    index = index.masked_fill(~mask, float("-inf"))
    order = torch.sort(index, dim=-1, descending=True, stable=True)  # ties: lowest first
    k = min(topk, index.shape[-1])
    pos = order.indices[..., :k]
    pos = torch.where(order.values[..., :k] > float("-inf"), pos, -1).to(torch.int32)
    if k < topk:
        pos = torch.cat([pos, pos.new_full((n, num_q, topk - k), -1)], dim=-1)
    last = torch.iinfo(torch.int32).max  # ascending position order, the -1s after
    pos = torch.where(pos < 0, last, pos).sort(dim=-1).values
    pos = torch.where(pos == last, -1, pos)
    ties = 0
    if count_ties and index.shape[-1] > topk:
        kth, nxt = order.values[..., topk - 1], order.values[..., topk]
        ties = int(((kth == nxt) & (nxt > float("-inf"))).sum())
    return pos, ties


def dsa_attention_ref(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                      positions: torch.Tensor, scale: float, kv_lora_rank: int,
                      packed: bool = False) -> torch.Tensor:
    """Absorbed MLA of each query over its selected context positions only.

    Args:
        q: [T, H, L + R] absorbed queries [q_nope @ W_UK | rotated q_rope].
        latent_cache: [num_blocks, block_size, L + R].
        positions: [T, topk] int32 from `indexer_topk_ref` (-1: none).
        kv_lora_rank: L; the values are the first L entries of each cached row.
        packed: accepted for the backends' common signature (registry.DsaAttentionFn); the
            reference reads every slot either way.
    Returns:
        [T, H, L] in q's dtype (softmax in fp32).
    """
    assert meta.block_size == latent_cache.shape[1], (meta.block_size, latent_cache.shape)
    num_tokens, heads = q.shape[:2]
    out = q.new_empty(num_tokens, heads, kv_lora_rank)
    if num_tokens == 0:
        return out
    block_size, width = latent_cache.shape[1:]
    flat = latent_cache.view(-1, width)
    step = max(1, _CHUNK_ELEMS // (positions.shape[1] * max(width, heads)))
    for t0 in range(0, num_tokens, step):
        t = slice(t0, t0 + step)
        pos = positions[t].long()  # [n, k]
        valid = pos >= 0
        pos = pos.clamp(min=0)
        tables = meta.block_tables[meta.token_to_req[t]]  # [n, max_blocks]
        slots = tables.gather(1, pos // block_size).long() * block_size + pos % block_size
        rows = flat[slots].float()  # [n, k, L + R]
        scores = torch.einsum("thd,tkd->thk", q[t].float(), rows) * scale
        probs = scores.masked_fill(~valid[:, None], float("-inf")).softmax(dim=-1)
        out[t] = torch.einsum("thk,tkl->thl", probs, rows[..., :kv_lora_rank]).to(q.dtype)
    return out
