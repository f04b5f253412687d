"""kernels/routing/grouped_triton.py (the sigmoid, group-limited router in one launch) against
routing.select_experts_grouped and a scatter_add count: the routers of GLM-4.7-Flash (64
experts, one group), GLM-4.5 (160, not a power of two), DeepSeek-V3 (256 in 8 groups, 4 kept),
Kimi K2 (384) and a one-expert-a-group case; CPU runs the kernel under Triton's interpreter,
the GPU test in bf16 inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.routing.grouped_triton import (
    grouped_supported,
    select_experts_grouped_triton,
)
from moeserve.kernels.routing.select import select_experts_grouped
from tests.kernels.test_routing_triton import reference_counts, same_order

CASES = [  # (tokens, experts, top_k, groups, kept, scaling)
    (19, 64, 4, 1, 1, 1.8),  # GLM-4.7-Flash's shape (k 4 here)
    (7, 160, 8, 1, 1, 2.5),  # GLM-4.5: E not a power of two
    (33, 256, 8, 8, 4, 2.5),  # DeepSeek-V3
    (5, 8, 3, 8, 5, 1.0),  # one expert a group: a group's best alone
    (17, 32, 6, 4, 2, 1.0),  # k past one group's experts
    (11, 384, 8, 1, 1, 2.827),  # Kimi K2: past 256 experts, 8 tokens a program
]


def logits_and_bias(num_tokens: int, num_experts: int, seed: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose biased scores are well apart (a permutation of spaced values a row), so
    that an ulp of sigmoid cannot reorder them: the choice is exact, not a near tie."""
    gen = torch.Generator().manual_seed(seed)
    spaced = torch.linspace(-4.0, 4.0, num_experts)
    logits = torch.stack([spaced[torch.randperm(num_experts, generator=gen)]
                          for _ in range(num_tokens)])
    bias = torch.randint(0, 3, (num_experts,), generator=gen) * 0.001
    return logits, bias


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "groups", "kept", "scaling"),
                         CASES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_select_experts_grouped(num_tokens: int, num_experts: int, top_k: int,
                                        groups: int, kept: int, scaling: float,
                                        renormalize: bool) -> None:
    logits, bias = logits_and_bias(num_tokens, num_experts, num_tokens + num_experts)
    args = dict(num_groups=groups, topk_groups=kept, correction_bias=bias,
                renormalize=renormalize, scaling_factor=scaling)
    want_w, want_i = select_experts_grouped(logits, top_k, **args)
    counts = torch.full((num_experts,), 3, dtype=torch.int64)
    got_w, got_i = select_experts_grouped_triton(logits, top_k, counts=counts, **args)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(same_order(got_i, got_w)[0], same_order(want_i, want_w)[0])
    torch.testing.assert_close(same_order(got_i, got_w)[1], same_order(want_i, want_w)[1],
                               rtol=2e-6, atol=1e-7)
    assert torch.equal(counts, 3 + reference_counts(got_i, num_experts, None))


def test_group_limit_really_drops_experts_and_no_bias() -> None:
    """Three groups' best experts score alike (logit 5), but two of those groups have nothing
    else (-3): the two kept groups are the one with two good experts (5, 1) and the one with
    four fair ones (2, 1.9, 1.8, 1.7), so experts 4 and 8 are dropped though they outscore all
    but expert 0; no bias."""
    logits = torch.full((2, 16), -3.0)
    logits[:, [0, 4, 8]] = 5.0
    logits[:, [1, 2]] = 1.0
    logits[:, 12:16] = torch.tensor([2.0, 1.9, 1.8, 1.7])
    want_w, want_i = select_experts_grouped(logits, 4, num_groups=4, topk_groups=2)
    got_w, got_i = select_experts_grouped_triton(logits, 4, num_groups=4, topk_groups=2)
    assert [sorted(row) for row in got_i.tolist()] == [[0, 12, 13, 14]] * 2
    assert torch.equal(same_order(got_i, got_w)[0], same_order(want_i, want_w)[0])
    torch.testing.assert_close(same_order(got_i, got_w)[1], same_order(want_i, want_w)[1])
    ungrouped = select_experts_grouped_triton(logits, 4)[1]
    assert {4, 8} <= set(ungrouped[0].tolist())  # what the limit took away


def test_masked_counts_bf16_strided_and_empty() -> None:
    logits, bias = logits_and_bias(12, 64, 3)
    wide = torch.zeros(12, 80, dtype=torch.bfloat16)
    wide[:, :64] = logits.to(torch.bfloat16)
    mask = torch.tensor([1] * 9 + [0] * 3)  # graph padding rows count nothing
    counts = torch.zeros(64, dtype=torch.int64)
    got_w, got_i = select_experts_grouped_triton(wide[:, :64], 4, correction_bias=bias,
                                                 scaling_factor=1.8, counts=counts,
                                                 count_mask=mask)
    want_w, want_i = select_experts_grouped(wide[:, :64], 4, correction_bias=bias,
                                            scaling_factor=1.8)
    assert torch.equal(same_order(got_i, got_w)[0], same_order(want_i, want_w)[0])
    assert torch.equal(counts, reference_counts(got_i, 64, mask))
    w, i = select_experts_grouped_triton(torch.zeros(0, 64), 4)
    assert w.shape == (0, 4) and i.shape == (0, 4)


def test_supported_shapes_and_bad_input() -> None:
    assert grouped_supported(64, 1, 1) and grouped_supported(160, 1, 1)
    assert grouped_supported(256, 8, 4) and grouped_supported(160, 8, 8)  # all groups kept
    assert not grouped_supported(160, 8, 4)  # 20 experts a group
    assert not grouped_supported(2048, 1, 1)
    with pytest.raises(ValueError, match="need power-of-two groups"):
        select_experts_grouped_triton(torch.zeros(2, 160), 4, num_groups=8, topk_groups=4)
    with pytest.raises(ValueError, match="count_mask without counts"):
        select_experts_grouped_triton(torch.zeros(2, 64), 4,
                                      count_mask=torch.ones(2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_deepseek_shape_in_a_cuda_graph() -> None:
    logits, bias = logits_and_bias(1024, 256, 11)
    logits, bias = logits.cuda().to(torch.bfloat16), bias.cuda()
    counts = torch.zeros(256, dtype=torch.int64, device="cuda")
    args = dict(num_groups=8, topk_groups=4, correction_bias=bias, scaling_factor=2.5)
    select_experts_grouped_triton(logits, 8, counts=counts, **args)  # compiles
    counts.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_w, got_i = select_experts_grouped_triton(logits, 8, counts=counts, **args)
    graph.replay()
    want_w, want_i = select_experts_grouped(logits, 8, **args)
    assert torch.equal(same_order(got_i, got_w)[0], same_order(want_i, want_w)[0])
    torch.testing.assert_close(same_order(got_i, got_w)[1], same_order(want_i, want_w)[1],
                               rtol=2e-6, atol=1e-6)
    assert torch.equal(counts, reference_counts(got_i, 256, None))
