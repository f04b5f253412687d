"""Paged attention (torch path) against dense causal attention over the unpaged K/V."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from moeserve.kernels.attention.paged import (
    paged_attention_loop_ref,
    paged_attention_ref,
    write_kv,
)

HEAD_DIM = 16
MIXED = ([5, 17, 0, 12, 30, 0], [1, 1, 9, 7, 1, 1])  # decodes + prefill chunks, some mid-context


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    meta: AttentionMetadata
    expected: torch.Tensor  # [T, H, D] fp32, dense causal attention
    scale: float


def make_case(num_computed: list[int], num_scheduled: list[int], block_size: int = 4,
              num_kv_heads: int = 2, group: int = 4, dtype: torch.dtype = torch.float32,
              seed: int = 0) -> Case:
    """Random K/V per request, written through write_kv into shuffled blocks of a NaN pool."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, scale = num_kv_heads * group, HEAD_DIM ** -0.5
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3  # null block 0 + what rows need + spare
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, first = [], 0
    for n in blocks_per_req:
        tables.append(ids[first:first + n])
        first += n
    # NaN everywhere: reading any slot that was not written poisons the output
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, HEAD_DIM), float("nan"),
                          dtype=dtype)
    ks = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    qs = [torch.randn(s, num_heads, HEAD_DIM, generator=gen) for s in seq_lens]
    whole = build_attention_metadata([0] * len(seq_lens), seq_lens, tables, block_size, "cpu")
    write_kv(torch.cat(ks).to(dtype), torch.cat(vs).to(dtype), kv_cache, whole.slot_mapping)

    expected, q_step = [], []
    for k, v, q, start in zip(ks, vs, qs, num_computed, strict=True):
        # dense causal attention over all positions, then keep this step's queries
        k_rep = k.to(dtype).float().repeat_interleave(group, dim=1)  # [S, H, D]
        v_rep = v.to(dtype).float().repeat_interleave(group, dim=1)  # [S, H, D]
        qf = q.to(dtype).float()
        o = F.scaled_dot_product_attention(qf.transpose(0, 1), k_rep.transpose(0, 1),
                                           v_rep.transpose(0, 1), is_causal=True, scale=scale)
        expected.append(o.transpose(0, 1)[start:])
        q_step.append(q[start:])
    meta = build_attention_metadata(num_computed, num_scheduled, tables, block_size, "cpu")
    return Case(torch.cat(q_step).to(dtype), kv_cache, meta, torch.cat(expected), scale)


def check(case: Case, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    out = paged_attention_ref(case.q, case.kv_cache, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out.float(), case.expected, atol=atol, rtol=rtol)
    loop = paged_attention_loop_ref(case.q, case.kv_cache, case.meta, case.scale)
    torch.testing.assert_close(loop.float(), case.expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch(group: int, block_size: int) -> None:
    check(make_case(*MIXED, block_size=block_size, group=group))


@pytest.mark.parametrize("block_size", [4, 16])
def test_pure_prefill(block_size: int) -> None:
    check(make_case([0, 0, 0], [7, 21, 3], block_size=block_size))


@pytest.mark.parametrize("group", [1, 4])
def test_pure_decode(group: int) -> None:
    check(make_case([4, 9, 30, 0, 15], [1] * 5, group=group))


def test_single_token() -> None:
    check(make_case([0], [1]))


def test_prefill_chunks_only_mid_context() -> None:
    check(make_case([8, 3], [5, 2], block_size=4, group=2))


def test_vectorised_matches_loop_ref() -> None:
    case = make_case(*MIXED, block_size=4, group=4, seed=3)
    out = paged_attention_ref(case.q, case.kv_cache, case.meta, case.scale)
    loop = paged_attention_loop_ref(case.q, case.kv_cache, case.meta, case.scale)
    torch.testing.assert_close(out, loop, atol=1e-5, rtol=1e-5)


def test_empty_step() -> None:
    meta = build_attention_metadata([], [], [], 4, "cpu")
    q = torch.randn(0, 8, HEAD_DIM)
    kv_cache = torch.zeros(2, 2, 4, 2, HEAD_DIM)
    assert paged_attention_ref(q, kv_cache, meta, 0.25).shape == (0, 8, HEAD_DIM)


def test_decode_rows_are_not_padded_to_the_prefill_length(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(*MIXED)
    calls: list[tuple[int, ...]] = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    out = paged_attention_ref(case.q, case.kv_cache, case.meta, case.scale)
    torch.testing.assert_close(out, case.expected, atol=1e-5, rtol=1e-5)
    # 4 decode rows with one query each, 2 prefill rows padded to the longest chunk (9)
    assert sorted(calls) == [(2, 8, 9, HEAD_DIM), (4, 8, 1, HEAD_DIM)]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision(dtype: torch.dtype, tol: float) -> None:
    case = make_case(*MIXED, block_size=4, group=4, dtype=dtype)
    check(case, atol=tol, rtol=tol)


def test_write_kv_puts_tokens_at_their_slots() -> None:
    block_size, kvh = 4, 2
    kv_cache = torch.full((2, 6, block_size, kvh, HEAD_DIM), float("nan"))
    slot_mapping = torch.tensor([9, 2, 20, 21, 7])  # scattered blocks 2, 0, 5, 5, 1
    k = torch.randn(5, kvh, HEAD_DIM)
    v = torch.randn(5, kvh, HEAD_DIM)
    write_kv(k, v, kv_cache, slot_mapping)
    for t, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        torch.testing.assert_close(kv_cache[0, block, offset], k[t], rtol=0, atol=0)
        torch.testing.assert_close(kv_cache[1, block, offset], v[t], rtol=0, atol=0)
    written = torch.zeros(6 * block_size, dtype=torch.bool)
    written[slot_mapping] = True
    untouched = kv_cache.view(2, -1, kvh, HEAD_DIM)[:, ~written]
    assert untouched.isnan().all()


def test_select_rows_gives_a_slice_for_consecutive_tokens() -> None:
    """A subset of rows whose tokens are consecutive selects them by a slice (a view, no
    gather), any other by device indices; the sub-step's metadata is the same either way."""
    from moeserve.kernels.attention.metadata import select_rows

    computed, scheduled = [5, 9, 0, 3, 0], [1, 1, 4, 1, 6]  # tokens: 0, 1, 2-5, 6, 7-12
    tables = [[0, 1], [2, 3], [4], [5], [6, 7]]
    meta = build_attention_metadata(computed, scheduled, tables, 8, "cpu")
    first, tok = select_rows(meta, np.array([0, 1, 2]))
    assert tok == slice(0, 6)
    later, tok_later = select_rows(meta, np.array([3, 4]))
    assert tok_later == slice(6, 13)
    apart, tok_apart = select_rows(meta, np.array([0, 3]))
    assert isinstance(tok_apart, torch.Tensor) and tok_apart.tolist() == [0, 6]
    x = torch.arange(13)
    assert x[tok].tolist() == list(range(6)) and x[tok_later].tolist() == list(range(6, 13))
    for sub, rows in ((first, [0, 1, 2]), (later, [3, 4]), (apart, [0, 3])):
        want = build_attention_metadata([computed[r] for r in rows],
                                        [scheduled[r] for r in rows],
                                        [tables[r] for r in rows], 8, "cpu")
        for name in ("positions", "slot_mapping", "seq_lens", "query_start_loc",
                     "token_to_req"):
            assert torch.equal(getattr(sub, name), getattr(want, name)), name
        assert torch.equal(sub.block_tables[:, :want.block_tables.shape[1]],
                           want.block_tables)


def test_bounded_groups_keep_padding_within_the_longest_row() -> None:
    from moeserve.kernels.attention.paged import bounded_groups

    # a long row and a short one: apart (together they pad the short one to 200k)
    q, s = np.array([8000, 192]), np.array([10_000, 200_000])
    assert [g.tolist() for g in bounded_groups(q, s, np.array([3, 5]))] == [[5], [3]]
    # W1's short prompts: groups of rows x longest context <= the step's tokens
    q, s = np.full(64, 128), np.arange(129, 193)
    groups = bounded_groups(q, s, np.arange(64))
    assert sorted(np.concatenate(groups).tolist()) == list(range(64))
    assert all(len(g) * int(s[g].max()) <= 64 * 128 for g in groups) and len(groups) == 2
    assert bounded_groups(np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                          np.array([], dtype=np.int64)) == []
    # four fresh 4,096-token prompts fit one group by bytes, but its mask (4 x 4,096 x 4,096)
    # passes MAX_MASK_ELEMENTS: row by row (each attends without a mask)
    from moeserve.kernels.attention.paged import MAX_MASK_ELEMENTS

    q = s = np.full(4, 4096)
    assert 4 * 4096 * 4096 > MAX_MASK_ELEMENTS
    assert [g.tolist() for g in bounded_groups(q, s, np.array([7, 2, 9, 4]))] == [
        [2], [4], [7], [9]]
