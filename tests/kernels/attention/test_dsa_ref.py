"""The DSA torch references (kernels/attention/dsa/reference.py) against plain per-token loops: the
indexer's top-k over the paged key cache (mixed steps, decode-only steps, chunks after a
prefix), ties to the lowest position, short contexts selecting everything, the decode path on
device tensors alone; and the sparse MLA over the selected rows against the dense absorbed MLA.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.dsa.reference import (
    dsa_attention_ref,
    indexer_topk_ref,
    write_index_keys,
)
from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.mla.reference import mla_attention_ref

BS, NB, HEADS, DIM, TOPK = 4, 48, 8, 16, 8


def _step(computed: list[int], scheduled: list[int], seed: int = 0):
    """A step's metadata over scattered blocks, an indexer cache filled with random keys at
    every context slot, random queries and fp32 weights."""
    rng = random.Random(seed)
    free = list(range(1, NB))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + s) // BS))] for c, s in
              zip(computed, scheduled, strict=True)]
    meta = build_attention_metadata(computed, scheduled, tables, BS, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NB, BS, DIM, generator=gen)
    t = meta.num_tokens
    q = torch.randn(t, HEADS, DIM, generator=gen)
    w = torch.randn(t, HEADS, generator=gen)
    return meta, tables, cache, q, w


def _loop_topk(q, w, cache, meta, tables, scale, topk):
    """Per token: scores over its causal context, sorted by (-score, position)."""
    flat = cache.view(-1, DIM)
    out = []
    for tok in range(meta.num_tokens):
        row, pos = int(meta.token_to_req_np[tok]), int(meta.positions[tok])
        slots = [tables[row][s // BS] * BS + s % BS for s in range(pos + 1)]
        k = flat[slots]  # [p + 1, D]
        score = (torch.relu(q[tok] @ k.T * scale) * w[tok][:, None]).sum(0)  # [p + 1]
        order = sorted(range(pos + 1), key=lambda s: (-float(score[s]), s))[:topk]
        out.append(order + [-1] * (topk - len(order)))
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("computed,scheduled", [
    ([0, 0, 0], [5, 30, 12]),  # prefills, one within topk
    ([20, 0, 7, 33], [1, 17, 1, 9]),  # decodes beside a prefill and a chunk after a prefix
    ([20, 3, 40], [1, 1, 1]),  # decode only (device indices)
])
def test_topk_matches_the_loop(computed: list[int], scheduled: list[int]) -> None:
    meta, tables, cache, q, w = _step(computed, scheduled)
    scale = DIM ** -0.5
    got, ties = indexer_topk_ref(q, w, cache, meta, scale, TOPK, count_boundary_ties=True)
    want = _loop_topk(q, w, cache, meta, tables, scale, TOPK)
    assert ties == 0
    # the same positions; the order within a selection may differ by rounding only when two
    # scores are equal to it
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    counts = (got >= 0).sum(-1)
    assert torch.equal(counts, torch.clamp(meta.positions + 1, max=TOPK).int())


def test_ties_break_to_the_lowest_position_and_are_counted() -> None:
    """Keys equal at every position of a context of 20 (every score ties): positions 0..7
    are chosen; with the scores distinct except a tie at the k-th place, the lower of the two
    tied positions is kept."""
    meta, tables, cache, q, w = _step([19], [1])
    flat = cache.view(-1, DIM)
    slots = [tables[0][s // BS] * BS + s % BS for s in range(20)]
    flat[slots] = flat[slots[0]].clone()
    pos, ties = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK, count_boundary_ties=True)
    assert pos[0].tolist() == list(range(TOPK)) and ties == 1
    # distinct keys, then an unselected position made a copy of the 8th best's key
    meta, tables, cache, q, w = _step([19], [1], seed=4)
    flat = cache.view(-1, DIM)
    slots = [tables[0][s // BS] * BS + s % BS for s in range(20)]
    pos, _ = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK)
    best = pos[0].tolist()  # ascending positions: the k-th best is the one top-(k - 1) drops
    fewer, _ = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK - 1)
    (kth,) = set(best) - set(fewer[0].tolist())
    rest = [s for s in range(20) if s not in best]
    twin = rest[len(rest) // 2]
    flat[slots[twin]] = flat[slots[kth]].clone()
    pos, ties = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK, count_boundary_ties=True)
    assert ties == 1
    low, high = sorted((kth, twin))
    assert low in pos[0].tolist() and high not in pos[0].tolist()


def test_a_context_of_at_most_topk_selects_everything() -> None:
    meta, _, cache, q, w = _step([0, 3], [8, 1])
    pos, _ = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK)
    for tok in range(meta.num_tokens):
        p = int(meta.positions[tok])
        assert sorted(s for s in pos[tok].tolist() if s >= 0) == list(range(p + 1))
        assert (pos[tok] == -1).sum() == TOPK - p - 1


def test_decode_uses_device_tensors_alone() -> None:
    """The decode path ignores the host lengths (placeholders in CUDA-graph buffers) and pads
    with -1 when max_seq_len is below topk."""
    meta, _, cache, q, w = _step([20, 3, 40], [1, 1, 1])
    want, _ = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK)
    ones = np.ones(3, dtype=np.int64)
    meta.seq_lens_np, meta.exact_host_lens = ones, False
    got, _ = indexer_topk_ref(q, w, cache, meta, DIM ** -0.5, TOPK)
    assert torch.equal(got, want)
    short, _, cache, q, w = _step([2, 4], [1, 1])
    pos, _ = indexer_topk_ref(q, w, cache, short, DIM ** -0.5, TOPK)
    assert pos.shape == (2, TOPK) and ((pos >= 0).sum(-1) == torch.tensor([3, 5])).all()


def test_write_index_keys_fills_the_slots() -> None:
    meta, _, _, _, _ = _step([0], [6])
    cache = torch.zeros(NB, BS, DIM)
    keys = torch.randn(6, DIM)
    write_index_keys(keys, cache, meta.slot_mapping)
    assert torch.equal(cache.view(-1, DIM)[meta.slot_mapping], keys)


L, R, H = 32, 16, 4


def _latent_step(computed: list[int], scheduled: list[int]):
    meta, tables, _, _, _ = _step(computed, scheduled, seed=1)
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(NB, BS, L + R, generator=gen)
    q = torch.randn(meta.num_tokens, H, L + R, generator=gen)
    return meta, tables, latent, q


def test_sparse_attention_over_every_position_is_the_dense_mla() -> None:
    meta, _, latent, q = _latent_step([20, 0, 7], [1, 17, 9])
    every = torch.full((meta.num_tokens, 64), -1, dtype=torch.int32)
    for tok in range(meta.num_tokens):
        p = int(meta.positions[tok])
        every[tok, :p + 1] = torch.randperm(p + 1, generator=torch.Generator().manual_seed(tok))
    got = dsa_attention_ref(q, latent, meta, every, 0.1, L)
    want = mla_attention_ref(q, latent, meta, 0.1, L)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sparse_attention_attends_to_the_selection_only() -> None:
    meta, tables, latent, q = _latent_step([30, 12], [1, 3])
    gen = torch.Generator().manual_seed(3)
    pos = torch.full((meta.num_tokens, TOPK), -1, dtype=torch.int32)
    for tok in range(meta.num_tokens):
        p = int(meta.positions[tok])
        pick = torch.randperm(p + 1, generator=gen)[:5]
        pos[tok, :5] = pick
    got = dsa_attention_ref(q, latent, meta, pos, 0.1, L)
    flat = latent.view(-1, L + R)
    for tok in range(meta.num_tokens):
        row = int(meta.token_to_req_np[tok])
        slots = [tables[row][s // BS] * BS + s % BS for s in pos[tok, :5].tolist()]
        rows = flat[slots]  # [5, L + R]
        probs = (q[tok] @ rows.T * 0.1).softmax(-1)  # [H, 5]
        torch.testing.assert_close(got[tok], probs @ rows[:, :L], rtol=1e-5, atol=1e-6)
