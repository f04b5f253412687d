"""Per-step attention metadata: the tensors every attention backend reads, built once per step.

`build_attention_metadata` turns the scheduler's per-request ints into tensors with numpy, with
no per-token Python loop (one small loop over requests only to copy block tables). It is passed
explicitly to `model.forward(input_ids, positions, attn_meta)`, never through a global.

Layout, for B requests (rows) and T = sum(query_lens) tokens in the step:

    row b:  context [0, seq_lens[b])  = computed before  [0, start)  + this step [start, seq_len)
            start = seq_lens[b] - query_lens[b];  tokens query_start_loc[b] : query_start_loc[b+1]
    token t: position positions[t], KV slot slot_mapping[t], row token_to_req[t]
    slot of position p in row b: block_tables[b, p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block 0
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    query_start_loc: torch.Tensor  # [B + 1] int32, cu_seqlens of the step's tokens
    token_to_req: torch.Tensor  # [T] int64, the row of each token
    block_size: int
    max_query_len: int
    max_seq_len: int
    # host copies (numpy) for backends that split the batch on the CPU side
    query_lens_np: np.ndarray  # [B] int64
    seq_lens_np: np.ndarray  # [B] int64
    token_to_req_np: np.ndarray  # [T] int64
    # False when the host lengths above are placeholders (a CUDA-graph decode: every row ones);
    # a backend then decides on the device tensors alone (DSA: every row sparse)
    exact_host_lens: bool = True
    # per-step tensors a backend derives from the above, built by its first layer and reused by
    # the others (one host-to-device copy per step, not one per layer)
    derived: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_np.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_attention_metadata(num_computed_tokens: list[int], num_scheduled_tokens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str) -> AttentionMetadata:
    """Build the step's metadata from the scheduler's per-request lists.

    Args:
        num_computed_tokens: per row, tokens already in the KV cache before this step.
        num_scheduled_tokens: per row, tokens computed this step (>= 1).
        block_tables: per row, the request's KV block ids (enough to hold seq_len tokens).
        block_size: tokens per KV block.
    """
    start = np.asarray(num_computed_tokens, dtype=np.int64)  # [B]
    query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)  # [B]
    seq_lens = start + query_lens
    num_reqs = len(query_lens)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    token_to_req = np.repeat(np.arange(num_reqs, dtype=np.int64), query_lens)  # [T]
    positions = np.arange(num_tokens, dtype=np.int64) - cu[token_to_req] + start[token_to_req]

    max_blocks = max((len(bt) for bt in block_tables), default=1) or 1
    table = np.zeros((num_reqs, max_blocks), dtype=np.int32)  # [B, max_blocks]
    for i, bt in enumerate(block_tables):
        table[i, : len(bt)] = bt
    block_of_token = table[token_to_req, positions // block_size].astype(np.int64)
    slot_mapping = block_of_token * block_size + positions % block_size

    def put(a: np.ndarray) -> torch.Tensor:
        return to_device(a, device)

    return AttentionMetadata(
        positions=put(positions),
        slot_mapping=put(slot_mapping),
        block_tables=put(table),
        seq_lens=put(seq_lens.astype(np.int32)),
        query_start_loc=put(cu.astype(np.int32)),
        token_to_req=put(token_to_req),
        block_size=block_size,
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        query_lens_np=query_lens,
        seq_lens_np=seq_lens,
        token_to_req_np=token_to_req,
    )


def to_device(a: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host array on `device` without a stream sync: through pinned memory on CUDA (a copy
    from pageable memory makes CUDA wait for the stream's queued work first; a tensor already
    pinned is copied as it is)."""
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(a)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def select_rows(meta: AttentionMetadata, rows: np.ndarray
                ) -> tuple[AttentionMetadata, slice | torch.Tensor]:
    """The metadata of a subset of the step's rows (host indices, ascending), as if those rows
    were the whole step, and the selector of their tokens in the step: a slice when they are
    consecutive (the decode rows of a step that plans them first: `x[sel]` is then a view and
    `out[sel] = y` a plain copy, not a gather and a scatter: 36 ms of GLM-4.7-Flash's 310-ms
    mixed step at 1,024 rows, gpu_b9de9a5/call4_1ccc02b), else indices [n_tok] int64 on the
    device. Callers index activations with it (x[sel], out[sel] = y): a token-row slice keeps
    their 16-byte alignment. Builds host tensors: for eager (mixed) steps, not CUDA-graph
    replays."""
    q_lens = meta.query_lens_np[rows]
    cu_all = np.zeros(meta.num_reqs + 1, dtype=np.int64)
    np.cumsum(meta.query_lens_np, out=cu_all[1:])
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    row_of_tok = np.repeat(np.arange(len(rows), dtype=np.int64), q_lens)
    tok = cu_all[rows][row_of_tok] + np.arange(int(cu[-1]), dtype=np.int64) - cu[row_of_tok]
    device = meta.positions.device
    # the sub-step's own index tensors are gathered (fresh, aligned allocations: a view at an
    # offset would give Triton's kernels a pointer of another alignment, a new compiled variant)
    tok_t = to_device(tok, device)
    rows_t = to_device(rows.astype(np.int64), device)
    seq_lens = meta.seq_lens_np[rows]
    sub = AttentionMetadata(
        positions=meta.positions[tok_t], slot_mapping=meta.slot_mapping[tok_t],
        block_tables=meta.block_tables[rows_t], seq_lens=meta.seq_lens[rows_t],
        query_start_loc=to_device(cu.astype(np.int32), device),
        token_to_req=to_device(row_of_tok, device), block_size=meta.block_size,
        max_query_len=int(q_lens.max()) if len(rows) else 0,
        max_seq_len=int(seq_lens.max()) if len(rows) else 0,
        query_lens_np=q_lens, seq_lens_np=seq_lens, token_to_req_np=row_of_tok,
        exact_host_lens=meta.exact_host_lens)
    consecutive = len(tok) and int(tok[-1]) - int(tok[0]) + 1 == len(tok)
    return sub, slice(int(tok[0]), int(tok[-1]) + 1) if consecutive else tok_t


def longest_first(meta: AttentionMetadata, rows: torch.Tensor | None) -> torch.Tensor:
    """Decode rows (`rows` int32 row ids, or None for every row) ordered by context, longest
    first (ties: in order), int32 on the device: launched in that order, one program a row,
    the short rows fill the last wave's gaps (longest-processing-time first). One argsort a
    step, kept in meta.derived for its other layers (captured in a CUDA graph as any launch)."""
    # keyed by the rows' address and length: the entry holds the rows tensor, so no other
    # tensor takes that address during the step (a layer's new view of the same rows hits)
    key = ("longest_first", None if rows is None else (rows.data_ptr(), rows.numel()),
           meta.num_reqs)
    cached = meta.derived.get(key)
    if cached is None:
        ids = rows.long() if rows is not None else None
        lens = meta.seq_lens if ids is None else meta.seq_lens[ids]
        order = torch.argsort(lens, descending=True, stable=True)
        cached = meta.derived[key] = (rows, (order if ids is None else ids[order]).int())
    return cached[1]

