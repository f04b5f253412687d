"""Paged attention, torch path: write K/V into the block pool and attend over it.

Owns the KV cache write (`write_kv`) and two torch references of the paged attention read:
`paged_attention_ref` (vectorised, the "torch" attention backend, fast enough for GPU batches of
1-2,048 requests) and `paged_attention_loop_ref` (one request at a time, the ground truth in
tests). Triton kernels come later with the same signatures and register in `kernels/registry.py`.

KV cache of one layer, and where a token's K/V lives (in the model's dtype, or float8 e4m3 with
the engine's kv_cache_dtype="fp8": written by `to_cache_dtype`, unscaled and saturating at
+-448, and read back in the query's dtype):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]     (index 0 = K, 1 = V)
    slot s = block_id * block_size + offset  ->  kv_cache[:, s // block_size, s % block_size]
    position p of row b  ->  slot block_tables[b, p // block_size] * block_size + p % block_size

Data flow of one attention call (the step's new K/V are written first by `write_kv`):

    q [T, H, D] --pad by row--> [B, Qmax, H, D] --SDPA over K/V gathered by slot--> unpad [T, H, D]

Decode rows (query_len == 1) and the other rows (prefill chunks) are attended as two groups,
chosen on the host from `meta.query_lens_np`, so that one long prefill chunk does not pad
thousands of decode rows to its length. Neither group syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from moeserve.kernels.attention.metadata import AttentionMetadata, to_device

FP8_MAX = 448.0  # float8 e4m3's largest finite value
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's element type. Float8 e4m3 saturates at +-FP8_MAX: torch's plain cast
    turns a larger value into NaN, which would poison every later softmax over it."""
    if dtype in FP8_CACHE_DTYPES:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the step's keys and values into their cache slots, in place.

    Args:
        k, v: [T, num_kv_heads, head_dim], the model's dtype (stored in the cache's).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        slot_mapping: [T] int64, the flat slot of each token (see the module docstring).

    NOTE: padding tokens (CUDA-graph dummy rows) may all point at the null block; duplicate slots
    are allowed and leave an unspecified one of their values there.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # view (not reshape): a copy would silently drop the write
    write_slots(kv_cache[0].view(-1, num_kv_heads, head_dim), slot_mapping, k)  # [slots, KVH, D]
    write_slots(kv_cache[1].view(-1, num_kv_heads, head_dim), slot_mapping, v)


def write_slots(flat_cache: torch.Tensor, slot_mapping: torch.Tensor,
                values: torch.Tensor) -> None:
    """flat_cache[slot_mapping] = values, in place, in the cache's dtype (to_cache_dtype's rule
    for a float8 cache, whose bytes are copied: index_copy_ has no float8 kernel)."""
    if flat_cache.dtype in FP8_CACHE_DTYPES:
        values = to_cache_dtype(values, flat_cache.dtype).view(torch.uint8)
        flat_cache = flat_cache.view(torch.uint8)
    flat_cache.index_copy_(0, slot_mapping, values)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Causal attention of each row's new tokens over its whole context, read from the paged cache.

    The query at absolute position p of row b sees keys j with j <= p and j < seq_lens[b]; the
    step's own K/V must already be in the cache. GQA: query head h reads KV head
    h // (H // KVH), as Hugging Face's repeat_kv, through SDPA's enable_gqa (no K/V copy per
    head). Precision: SDPA's own; its fused kernels accumulate the softmax in fp32 for bf16/fp16
    inputs, and the output is in q's dtype. On an H200 (torch 2.11) SDPA picks cuDNN attention
    for a boolean mask with GQA (the memory-efficient kernel refuses GQA, the math fallback is
    ~25x slower); on CPU its flash kernel.

    Args:
        q: [T, H, D], tokens in the order of `meta` (row by row).
        kv_cache: [2, num_blocks, block_size, KVH, D].
        meta: the step's AttentionMetadata (block_size must equal kv_cache's).
        scale: softmax scale, usually D ** -0.5.
    Returns:
        [T, H, D] in q's dtype.

    NOTE: not CUDA-graph capturable: the padded shapes come from host lengths every step.
    """
    assert meta.block_size == kv_cache.shape[2], (meta.block_size, kv_cache.shape)
    return attend_in_groups(q, kv_cache, meta, scale, _attend, q.shape[-1])


# bounded_groups' largest causal mask a padded group builds (bool, and the attention's bias
# from it): 16 MiB of bool. A prefill row at a long context attends alone, without one (its
# mask at 8,192 tokens of a 202,752-token context: 1.5 GiB of bool and 3.1 GiB of bf16 bias)
MAX_MASK_ELEMENTS = 1 << 24

# attend(q_pad [B, Q, H, Dq], cache, block_tables [B, max_blocks], seq_lens [B], start [B],
#        max_seq_len, scale) -> [B, Q, H, Dout]: one padded group of rows
PaddedAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         int, float], torch.Tensor]


def attend_in_groups(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, attend: PaddedAttend, out_dim: int,
                     bounded: bool = False) -> torch.Tensor:
    """Run `attend` over the decode rows and the other rows of the step as two padded groups
    (chosen on the host), or over all rows at once when every row is a decode; returns
    [T, H, out_dim] in q's dtype. Shared by the GQA and MLA references. bounded: the other
    rows in `bounded_groups` instead of one group, for an `attend` that materialises each
    row's context (MLA's up-projected prefill)."""
    if q.shape[0] == 0:
        return q.new_empty(0, q.shape[1], out_dim)
    query_lens = meta.query_lens_np  # [B]
    is_decode = query_lens == 1
    if bool(is_decode.all()):  # pure decode: every index is already on the device
        start = meta.seq_lens.long() - 1  # [B] position of each row's one query
        out = attend(q[:, None], cache, meta.block_tables, meta.seq_lens.long(), start,
                     meta.max_seq_len, scale)  # [B, 1, H, out_dim]
        return out[:, 0]
    out = q.new_empty(q.shape[0], q.shape[1], out_dim)  # [T, H, out_dim]
    cu = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    others = np.flatnonzero(~is_decode)
    groups = (bounded_groups(query_lens[others], meta.seq_lens_np[others], others) if bounded
              else [others])
    for rows in (np.flatnonzero(is_decode), *groups):
        if len(rows):
            _attend_rows(q, cache, meta, cu, rows, scale, out, attend)
    return out


def bounded_groups(query_lens: np.ndarray, seq_lens: np.ndarray,
                   rows: np.ndarray) -> list[np.ndarray]:
    """`rows` (host indices, with their query and context lengths) cut into padded groups whose
    rows x longest context stays within max(the longest context, the rows' tokens): the
    contexts a group materialises are then no more than one row of the step's tokens at the
    longest context would, the case the memory plan profiles (kv_cache.profile_step: the
    budget's tokens at the end of a max_model_len context). Longest contexts first; a row
    alone always fits. One group of a long row and a short one had padded the short row to
    the long context: twice the long row's bytes. A group whose causal mask (rows x longest
    query x longest context) would pass MAX_MASK_ELEMENTS goes row by row: one row needs no
    mask (its queries are the context's last: `attend` aligns them lower right), so no step
    builds one larger than that."""
    if len(rows) == 0:
        return []
    limit = max(int(seq_lens.max()), int(query_lens.sum()))
    groups, current = [], []

    def close(group: list) -> None:
        if len(group) * int(query_lens[group].max()) * int(seq_lens[group[0]]) > MAX_MASK_ELEMENTS:
            groups.extend(rows[[i]] for i in sorted(group, key=lambda i: rows[i]))
        else:
            groups.append(np.sort(rows[group]))

    for i in np.argsort(-seq_lens, kind="stable"):  # a group's first row is its longest
        if current and (len(current) + 1) * int(seq_lens[current[0]]) > limit:
            close(current)
            current = []
        current.append(i)
    close(current)
    return groups


def _attend_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 cu: np.ndarray, rows: np.ndarray, scale: float, out: torch.Tensor,
                 attend: PaddedAttend) -> None:
    """Attend the tokens of `rows` (host indices) as one padded batch; write them into `out`."""
    q_lens = meta.query_lens_np[rows]  # [n]
    seq_lens = meta.seq_lens_np[rows]  # [n]
    num_rows, num_tok = len(rows), int(q_lens.sum())
    cu_group = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_group[1:])
    row_of_tok = np.repeat(np.arange(num_rows, dtype=np.int64), q_lens)  # [n_tok] row in group
    offset = np.arange(num_tok, dtype=np.int64) - cu_group[row_of_tok]  # [n_tok] offset in row
    tok = cu[rows][row_of_tok] + offset  # [n_tok] index into q
    # one host-to-device copy for every index this group needs
    host = np.concatenate([rows, seq_lens, seq_lens - q_lens, tok, row_of_tok, offset])
    dev = to_device(host, q.device)
    rows_t, seq_t, start_t = dev[:3 * num_rows].view(3, num_rows)  # [n] each
    tok_t, row_t, off_t = dev[3 * num_rows:].view(3, num_tok)  # [n_tok] each

    q_max = int(q_lens.max())
    if q_max == 1:
        q_pad = q[tok_t][:, None]  # [n, 1, H, D]
    else:
        q_pad = q.new_zeros(num_rows, q_max, *q.shape[1:])  # [n, Qmax, H, D]
        q_pad[row_t, off_t] = q[tok_t]
    o = attend(q_pad, kv_cache, meta.block_tables[rows_t], seq_t, start_t, int(seq_lens.max()),
               scale)  # [n, Qmax, H, Dout]
    out.index_copy_(0, tok_t, o[row_t, off_t])


def _attend(q_pad: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, start: torch.Tensor, max_seq_len: int,
            scale: float) -> torch.Tensor:
    """SDPA of padded queries over each row's context gathered from the cache.

    Args:
        q_pad: [B, Q, H, D]; query i of row b sits at position start[b] + i.
        block_tables: [B, max_blocks] int32.
        seq_lens: [B] int64, context length of each row (>= 1).
        start: [B] int64, position of each row's first query.
        max_seq_len: host int >= max(seq_lens), the padded context length L.
    Returns:
        [B, Q, H, D]. Padded query slots hold finite values that callers drop.
    """
    _, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    slots, mask = context_slots(block_tables, seq_lens, start, max_seq_len, block_size,
                                q_pad.shape[1])
    # NOTE: two plain gathers; one kv_cache.view(2, ...)[:, slots] ran 3x slower on an H200
    k = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots].to(q_pad.dtype)  # [B, L, KVH, D]
    v = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots].to(q_pad.dtype)  # [B, L, KVH, D]
    o = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, heads, len, D]
        attn_mask=mask[:, None], scale=scale, enable_gqa=True)  # [B, H, Q, D]
    return o.transpose(1, 2)


def context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor,
                  max_seq_len: int, block_size: int,
                  num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slot of every context position of each row, padded to max_seq_len (padding
    reads the row's last written slot: finite values), and the causal mask [B, Q, L] of query i
    at position start[b] + i."""
    device = block_tables.device
    key_pos = torch.arange(max_seq_len, device=device)  # [L]
    pos = torch.minimum(key_pos[None, :], seq_lens[:, None] - 1)  # [B, L]
    blocks = block_tables.gather(1, pos // block_size).long()  # [B, L]
    slots = blocks * block_size + pos % block_size  # [B, L]
    q_pos = start[:, None] + torch.arange(num_queries, device=device)  # [B, Q]
    mask = ((key_pos[None, None, :] <= q_pos[:, :, None])
            & (key_pos[None, None, :] < seq_lens[:, None, None]))  # [B, Q, L]
    return slots, mask


def paged_attention_loop_ref(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                             scale: float) -> torch.Tensor:
    """Same contract as `paged_attention_ref`, one request at a time, softmax in fp32.

    The ground truth for tests: plain indexing and einsum, no SDPA, no padding. Slow.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    group = q.shape[1] // num_kv_heads
    block_size = kv_cache.shape[2]
    k_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, KVH, D]
    v_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)  # [num_slots, KVH, D]
    tables = meta.block_tables.cpu().long()  # [B, max_blocks]
    out = torch.empty_like(q)  # [T, H, D]
    first = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_np.tolist(),
                                             meta.seq_lens_np.tolist(), strict=True)):
        key_pos = torch.arange(seq_len)  # [S]
        slots = (tables[b, key_pos // block_size] * block_size + key_pos % block_size).to(q.device)
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)  # [S, H, D]
        qb = q[first:first + q_len].float()  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", qb, k) * scale  # [H, Q, S]
        q_pos = torch.arange(seq_len - q_len, seq_len)  # [Q]
        visible = (key_pos[None, :] <= q_pos[:, None]).to(q.device)  # [Q, S]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [H, Q, S]
        out[first:first + q_len] = torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)
        first += q_len
    return out
