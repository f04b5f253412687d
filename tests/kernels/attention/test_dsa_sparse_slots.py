"""DSA's sparse MLA with `slot_rows` (attention/dsa/sparse_triton.py's experiment switch: the
selection turned into cache rows by `_slots_kernel` before the attention loop): the same bits as
the position path, over holey selections in random order (block sizes 16 and 6, one to three
partitions, a token of none, a position past its block table) and over the indexer's own
packed selection. Triton's interpreter on the CPU; the @pytest.mark.gpu case on the H200."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.attention.dsa import sparse_triton
from moeserve.kernels.attention.dsa.reference import indexer_topk_ref
from moeserve.kernels.attention.dsa.sparse_triton import dsa_attention_triton
from tests.kernels.attention.test_dsa_triton import (
    STEPS,
    TOPK,
    L,
    _holey_selection,
    _latents,
    make_step,
)


def _both(monkeypatch: pytest.MonkeyPatch, *args: object, **kw: object
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions path, slot rows path) outputs of dsa_attention_triton(*args, **kw)."""
    monkeypatch.setattr(sparse_triton, "slot_rows", False)
    by_position = dsa_attention_triton(*args, **kw)
    monkeypatch.setattr(sparse_triton, "slot_rows", True)
    return by_position, dsa_attention_triton(*args, **kw)


@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_slot_rows_give_the_same_bits_over_holes(block_size: int, num_splits: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    step = make_step(*STEPS["mixed"], block_size)
    pos = _holey_selection(step, 40, seed=9)
    pos[2] = -1  # a token of none: zeros either way
    past = step.meta.block_tables.shape[1] * block_size  # past every block table: never read
    pos[0, -1] = past
    q, latent = _latents(step.meta, 20, torch.float32)
    by_position, by_slot = _both(monkeypatch, q, latent, step.meta, pos, 0.1, L,
                                 num_splits=num_splits)
    assert torch.equal(by_slot, by_position)
    assert torch.equal(by_slot[2], torch.zeros_like(by_slot[2]))


def test_slot_rows_give_the_same_bits_over_the_indexer_selection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    step = make_step(*STEPS["mixed"], 16)
    positions, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, 0.25, TOPK)
    q, latent = _latents(step.meta, 5, torch.float32)
    by_position, by_slot = _both(monkeypatch, q, latent, step.meta, positions, 0.1, L,
                                 packed=True)
    assert torch.equal(by_slot, by_position)


@pytest.mark.gpu
def test_gpu_slot_rows_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    step = make_step(*STEPS["mixed"], 16, device="cuda", dtype=torch.bfloat16)
    positions, _ = indexer_topk_ref(step.q, step.w, step.cache, step.meta, 0.25, TOPK)
    q, latent = _latents(step.meta, 64, torch.bfloat16, device="cuda")
    by_position, by_slot = _both(monkeypatch, q, latent, step.meta, positions, 0.1, L,
                                 packed=True)
    assert torch.equal(by_slot, by_position)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 3])
def test_gpu_gluon_slot_rows_give_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                                num_splits: int | None) -> None:
    """decode_gluon.sparse_gluon with `slots` (the switch routes it there too): the same bits
    over the indexer's packed selection at GLM-5's latent width, and over a holey one with a
    token of none and a position past its block table. The position path pinned to
    decode_gluon's kernel (ws_sparse off): the slots take it, and decode_gluon_ws's sparse
    default sums in another order (bits apart, within 2^-6 on the H100)."""
    from moeserve.kernels.attention.mla import decode_gluon
    from tests.kernels.attention.test_mla_decode_gluon import gpu_sparse_inputs

    monkeypatch.setattr(decode_gluon, "ws_sparse", False)
    q, latent, meta, positions = gpu_sparse_inputs(64)
    by_position, by_slot = _both(monkeypatch, q, latent, meta, positions, 0.1, 512,
                                 num_splits=num_splits, packed=True, gluon=True)
    assert not by_position.isnan().any() and torch.equal(by_slot, by_position)
    holey = positions.flip(1).contiguous()  # valid ones last: not packed
    holey[1] = -1
    holey[0, 0] = meta.block_tables.shape[1] * latent.shape[1]  # past the table: never read
    by_position, by_slot = _both(monkeypatch, q, latent, meta, holey, 0.1, 512,
                                 num_splits=num_splits, gluon=True)
    assert torch.equal(by_slot, by_position)
    assert torch.equal(by_slot[1], torch.zeros_like(by_slot[1]))
