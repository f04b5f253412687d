"""GPU checks of the torch kernels in bf16: accuracy, no host sync, MoE inside a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.kernels.attention.metadata import AttentionMetadata, build_attention_metadata
from moeserve.kernels.attention.paged import (
    paged_attention_loop_ref,
    paged_attention_ref,
    write_kv,
)
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.routing.select import select_experts
from tests.cuda_graph import capture

pytestmark = pytest.mark.gpu
CUDA = "cuda"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 128, 16
HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 128, 8


def attention_step(num_computed: list[int], num_scheduled: list[int],
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A bf16 cache with every row's context written into shuffled blocks, and the step's q."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + s for c, s in zip(num_computed, num_scheduled, strict=True)]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    ids = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
    tables = [ids[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(blocks))]
    kv_cache = torch.zeros(2, sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                           device=CUDA)
    whole = build_attention_metadata([0] * len(seq_lens), seq_lens, tables, BLOCK, CUDA)
    kv = torch.randn(2, sum(seq_lens), KV_HEADS, HEAD_DIM, device=CUDA, dtype=torch.bfloat16)
    write_kv(kv[0], kv[1], kv_cache, whole.slot_mapping)
    meta = build_attention_metadata(num_computed, num_scheduled, tables, BLOCK, CUDA)
    q = torch.randn(sum(num_scheduled), HEADS, HEAD_DIM, device=CUDA, dtype=torch.bfloat16)
    return q, kv_cache, meta


def test_paged_attention_bf16_mixed_batch() -> None:
    rng = np.random.default_rng(0)
    computed = rng.integers(0, 300, 200).tolist() + [0, 40, 97]
    scheduled = [1] * 200 + [64, 128, 33]
    q, kv_cache, meta = attention_step(computed, scheduled)
    out = paged_attention_ref(q, kv_cache, meta, HEAD_DIM ** -0.5)
    expected = paged_attention_loop_ref(q, kv_cache, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_paged_attention_decode_has_no_host_sync() -> None:
    q, kv_cache, meta = attention_step([100, 7, 250, 31], [1, 1, 1, 1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = paged_attention_ref(q, kv_cache, meta, HEAD_DIM ** -0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = paged_attention_loop_ref(q, kv_cache, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def moe_inputs(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, device=CUDA, generator=gen).bfloat16()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=CUDA, generator=gen)
           * HIDDEN ** -0.5).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=CUDA, generator=gen)
    w2 = (w2 * INTER ** -0.5).bfloat16()
    logits = torch.randn(num_tokens, EXPERTS, device=CUDA, generator=gen)
    return x, w13, w2, logits


@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_grouped_mm_bf16_matches_loop_ref(num_tokens: int) -> None:
    x, w13, w2, logits = moe_inputs(num_tokens)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    expected = moe_loop_ref(x.float(), w13.float(), w2.float(), weights, ids)
    out = moe_grouped_mm(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_routing_and_grouped_mm_have_no_host_sync() -> None:
    x, w13, w2, logits = moe_inputs(64)
    moe_grouped_mm(x, w13, w2, *select_experts(logits, TOP_K, renormalize=True))  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_grouped_mm(x, w13, w2, *select_experts(logits, TOP_K, renormalize=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape


def test_grouped_mm_replays_in_a_cuda_graph() -> None:
    x, w13, w2, logits = moe_inputs(96)
    static_x, static_logits = x.clone(), logits.clone()

    def step() -> torch.Tensor:
        return moe_grouped_mm(static_x, w13, w2,
                              *select_experts(static_logits, TOP_K, renormalize=True))

    graph, static_out = capture(step)
    x2, _, _, logits2 = moe_inputs(96, seed=1)  # new tokens, new routing
    static_x.copy_(x2)
    static_logits.copy_(logits2)
    graph.replay()
    torch.testing.assert_close(static_out, step(), atol=0, rtol=0)
    torch.testing.assert_close(
        static_out.float(),
        moe_loop_ref(x2.float(), w13.float(), w2.float(),
                     *select_experts(logits2, TOP_K, renormalize=True)),
        atol=2e-2, rtol=2e-2)
