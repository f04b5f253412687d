"""kernels/routing/select_triton.py against routing.select_experts and a scatter_add count; CPU runs
the kernel under Triton's interpreter (tests/conftest.py), the GPU tests in bf16 and a graph."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.routing.select import select_experts
from moeserve.kernels.routing.select_triton import select_experts_triton

DEVICE = "cpu"


def same_order(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (expert, weight) pairs sorted by expert: a comparison blind to tie order."""
    ids_sorted, order = ids.sort(dim=1)
    return ids_sorted, weights.gather(1, order)


def reference_counts(ids: torch.Tensor, num_experts: int,
                     mask: torch.Tensor | None) -> torch.Tensor:
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    ones = (torch.ones_like(ids) if mask is None
            else mask[:, None].expand(-1, ids.shape[1])).reshape(-1)
    return counts.scatter_add_(0, ids.reshape(-1), ones)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"),
                         [(1, 8, 2), (17, 16, 2), (40, 60, 4), (33, 128, 8), (5, 3, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_select_experts(num_tokens: int, num_experts: int, top_k: int,
                                renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    expected_w, expected_i = select_experts(logits, top_k, renormalize)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    w, i = select_experts_triton(logits, top_k, renormalize, counts=counts)
    assert i.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(i, expected_i)
    torch.testing.assert_close(w, expected_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, reference_counts(i, num_experts, None))


def test_bf16_logits_strided_and_masked_counts() -> None:
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(21, 40, generator=gen).to(torch.bfloat16)
    logits = wide[:, :32]  # row stride 40
    mask = torch.tensor([1] * 15 + [0] * 6)  # the last six rows: graph padding
    counts = torch.full((32,), 5, dtype=torch.int64)  # adds to what is there
    w, i = select_experts_triton(logits, 4, True, counts=counts, count_mask=mask)
    expected_w, expected_i = select_experts(logits, 4, True)
    # bf16 logits tie exactly (rows 11 and 14 here): the same experts, in another order
    assert torch.equal(same_order(i, w)[0], same_order(expected_i, expected_w)[0])
    torch.testing.assert_close(same_order(i, w)[1], same_order(expected_i, expected_w)[1],
                               rtol=1e-6, atol=1e-7)
    assert (i != expected_i).any(dim=1).sum() == 2
    assert torch.equal(counts, 5 + reference_counts(i, 32, mask))


def test_ties_pick_the_lowest_index_and_empty_batch() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    w, i = select_experts_triton(logits, 2, False)
    assert i.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(w[1], torch.tensor([0.25, 0.25]))
    w, i = select_experts_triton(torch.empty(0, 8), 2, True)
    assert w.shape == (0, 2) and i.shape == (0, 2)


@pytest.mark.parametrize(("change", "message"), [
    ({"top_k": 0}, "top_k must be in 1..8"),
    ({"top_k": 9}, "top_k must be in 1..8"),
    ({"logits": torch.zeros(4, 8, dtype=torch.int64)}, "router_logits must be a float"),
    ({"logits": torch.zeros(4)}, "router_logits must be a float"),
    ({"counts": torch.zeros(8, dtype=torch.int32)}, "counts must be a contiguous int64 \\[8\\]"),
    ({"counts": torch.zeros(7, dtype=torch.int64)}, "counts must be a contiguous int64 \\[8\\]"),
    ({"count_mask": torch.ones(4, dtype=torch.int64)}, "count_mask without counts"),
    ({"counts": torch.zeros(8, dtype=torch.int64), "count_mask": torch.ones(3, dtype=torch.int64)},
     "count_mask must be a contiguous int64 \\[4\\]"),
])
def test_bad_input_is_named(change: dict, message: str) -> None:
    args = {"logits": torch.zeros(4, 8), "top_k": 2, "counts": None, "count_mask": None} | change
    with pytest.raises(ValueError, match=message):
        select_experts_triton(args["logits"], args["top_k"], True, counts=args["counts"],
                              count_mask=args["count_mask"])


@pytest.mark.gpu
def test_gpu_bf16_qwen_shape_and_cuda_graph() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(2048, 128, device="cuda", generator=gen).to(torch.bfloat16)
    mask = torch.ones(2048, dtype=torch.int64, device="cuda")
    mask[-100:] = 0
    expected_w, expected_i = select_experts(logits, 8, True)
    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    w, i = select_experts_triton(logits, 8, True, counts=counts, count_mask=mask)
    ids, ws = same_order(i, w)
    expected_ids, expected_ws = same_order(expected_i, expected_w)
    same = (ids == expected_ids).all(dim=1)
    assert same.float().mean().item() >= 0.999, f"{same.float().mean():.4%} chose the same set"
    torch.testing.assert_close(ws[same], expected_ws[same], rtol=1e-5, atol=1e-6)
    assert torch.equal(counts, reference_counts(i, 128, mask))
    # inside a CUDA graph: replays recount on the same buffer
    static_counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        select_experts_triton(logits, 8, True, counts=static_counts, count_mask=mask)
    torch.cuda.current_stream().wait_stream(stream)
    static_counts.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gi = select_experts_triton(logits, 8, True, counts=static_counts, count_mask=mask)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gi, i) and torch.equal(gw, w)
    assert torch.equal(static_counts, 2 * reference_counts(i, 128, mask))
