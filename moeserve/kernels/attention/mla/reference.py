"""Multi-head latent attention (MLA) over the paged latent cache, torch path.

The cache of one layer holds, per token, the normalised KV latent and the rotated rotary key,
one shared "head" for all query heads:

    latent_cache: [num_blocks, block_size, L + R]   L = kv_lora_rank, R = qk_rope_head_dim
    slot s -> latent_cache.view(-1, L + R)[s]        (slots as in kernels/attention/paged.py)

in the model's dtype, or float8 e4m3 (the engine's kv_cache_dtype="fp8": written by paged.py's
to_cache_dtype rule, read back in the queries' dtype).

Two forms of the same attention (softmax(q . k * scale) v per head h):

- absorbed (`mla_attention_ref`; decode, and any row): the key up-projection W_UK[h] is folded
  into the query, so each head's query is q_lat[h] = [q_nope[h] @ W_UK[h] | q_rope[h]] (L + R)
  and attends straight over the cached rows; the output is the weighted sum of the latents
  [T, H, L], which the caller multiplies by W_UV[h]. One cache row is read once for every head.
- up-projected (`mla_prefill_ref`, the MHA form; prefill chunks and prefix hits): the cached
  latents of each row's context are up-projected by kv_b_proj to per-head k_nope and v, joined
  with the shared rotary key, and attended as ordinary multi-head attention: fewer FLOPs per
  query token when many queries share a context.

The Triton kernel of the absorbed form (absorbed_triton.py) has the same contract
as `mla_attention_ref`. Neither form syncs with the device on a pure decode step.
"""

from __future__ import annotations

import functools

import torch

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla.up_projected import attend_row_in_chunks
from moeserve.kernels.attention.paged import attend_in_groups, context_slots, write_slots


def write_latent(latent: torch.Tensor, latent_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write the step's [T, L + R] latent rows (the model's dtype) into their slots, in place,
    in the cache's dtype (a float8 e4m3 cache by paged.to_cache_dtype's rule). Padding
    tokens may share the null block's slots (any one of their rows stays)."""
    write_slots(latent_cache.view(-1, latent_cache.shape[-1]), slot_mapping, latent)


def mla_attention_ref(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA: causal attention of each row's queries over its cached latent rows.

    Args:
        q: [T, H, L + R], each head's absorbed query [q_nope @ W_UK | rotated q_rope].
        latent_cache: [num_blocks, block_size, L + R]; the step's own rows already written.
        meta: the step's metadata (block_size equal to the cache's).
        scale: the softmax scale (qk_head_dim ** -0.5, times YaRN's mscale correction).
        kv_lora_rank: L; the values are the first L entries of each cached row.
    Returns:
        [T, H, L] in q's dtype (softmax in fp32).
    """
    assert meta.block_size == latent_cache.shape[1], (meta.block_size, latent_cache.shape)
    attend = functools.partial(_attend_absorbed, kv_lora_rank=kv_lora_rank)
    return attend_in_groups(q, latent_cache, meta, scale, attend, kv_lora_rank)


def mla_prefill_ref(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, kv_b_proj: torch.Tensor, qk_nope_head_dim: int,
                    v_head_dim: int) -> torch.Tensor:
    """Up-projected MLA (the MHA form): the context's latents through kv_b_proj, then causal
    multi-head attention.

    Args:
        q: [T, H, nope + R], each head's [q_nope | rotated q_rope].
        latent_cache: [num_blocks, block_size, L + R].
        kv_b_proj: [H * (nope + v), L], HF's kv_b_proj.weight (per head: k_nope rows, v rows).
    Returns:
        [T, H, v] in q's dtype.
    """
    assert meta.block_size == latent_cache.shape[1], (meta.block_size, latent_cache.shape)
    attend = functools.partial(_attend_up_projected, kv_b_proj=kv_b_proj,
                               nope=qk_nope_head_dim, v_dim=v_head_dim)
    # each group materialises its rows' up-projected contexts: groups bounded by the longest
    return attend_in_groups(q, latent_cache, meta, scale, attend, v_head_dim, bounded=True)


def _gather(latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            start: torch.Tensor, max_seq_len: int, num_queries: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's context rows [B, S, L + R] from the cache in `dtype` (the queries': a float8
    cache is read back in it), and the causal mask [B, Q, S]."""
    slots, mask = context_slots(block_tables, seq_lens, start, max_seq_len,
                                latent_cache.shape[1], num_queries)
    return latent_cache.view(-1, latent_cache.shape[-1])[slots].to(dtype), mask


def _attend_absorbed(q_pad: torch.Tensor, latent_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor,
                     max_seq_len: int, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """q_pad [B, Q, H, L + R] -> [B, Q, H, L]."""
    rows, mask = _gather(latent_cache, block_tables, seq_lens, start, max_seq_len,
                         q_pad.shape[1], q_pad.dtype)  # [B, S, L + R]
    scores = torch.einsum("bqhd,bsd->bhqs", q_pad.float(), rows.float()) * scale
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1)  # [B, H, Q, S]
    out = torch.einsum("bhqs,bsl->bqhl", probs, rows[..., :kv_lora_rank].float())
    return out.to(q_pad.dtype)


def _attend_up_projected(q_pad: torch.Tensor, latent_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         start: torch.Tensor, max_seq_len: int, scale: float,
                         kv_b_proj: torch.Tensor, nope: int, v_dim: int) -> torch.Tensor:
    """q_pad [B, Q, H, nope + R] -> [B, Q, H, v], through SDPA (its fused kernels keep the
    [Q, S] scores of long prompts out of memory; the values may be narrower than the keys).
    One row of several queries (paged.attend_in_groups' groups of one: max_seq_len is its
    context, its queries the context's last) goes through up_projected.attend_row_in_chunks:
    its context in bounded chunks, no [Q, S] mask, no whole context up-projected."""
    num_heads, num_queries = q_pad.shape[2], q_pad.shape[1]
    if q_pad.shape[0] == 1 and num_queries > 1:
        return attend_row_in_chunks(q_pad[0], latent_cache, block_tables[0], max_seq_len,
                                    scale, kv_b_proj, nope, v_dim)[None]
    rows, mask = _gather(latent_cache, block_tables, seq_lens, start, max_seq_len,
                         num_queries, q_pad.dtype)  # [B, S, L + R]
    kv_lora_rank = kv_b_proj.shape[1]
    kv = torch.nn.functional.linear(rows[..., :kv_lora_rank], kv_b_proj)  # [B, S, H*(nope+v)]
    kv = kv.view(*kv.shape[:2], num_heads, nope + v_dim)
    k_rope = rows[..., None, kv_lora_rank:].expand(-1, -1, num_heads, -1)  # [B, S, H, R]
    k = torch.cat([kv[..., :nope], k_rope], dim=-1)  # [B, S, H, nope + R]
    v = kv[..., nope:]  # [B, S, H, v]
    o = torch.nn.functional.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, len, dim]
        attn_mask=mask[:, None], scale=scale)  # [B, H, Q, v]
    return o.transpose(1, 2)
