"""MoE experts: per-expert loop (ground truth, checked against HF) vs dense ref vs grouped_mm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.ref import moe_dense_ref, moe_loop_ref
from moeserve.kernels.routing.select import select_experts

HIDDEN, INTER = 32, 16


def make_experts(num_experts: int, dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * HIDDEN ** -0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * INTER ** -0.5
    return w13.to(dtype), w2.to(dtype)


def make_routing(num_tokens: int, num_experts: int, top_k: int,
                 seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k,
                                  renormalize=True)
    return x, weights, ids


def assert_all_agree(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    loop = moe_loop_ref(x, w13, w2, weights, ids)
    assert loop.shape == x.shape and loop.dtype == x.dtype
    torch.testing.assert_close(moe_dense_ref(x, w13, w2, weights, ids), loop)
    torch.testing.assert_close(moe_grouped_mm(x, w13, w2, weights, ids), loop)
    return loop


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("num_experts", [8, 64])
def test_backends_agree(num_experts: int, top_k: int, num_tokens: int) -> None:
    w13, w2 = make_experts(num_experts)
    x, weights, ids = make_routing(num_tokens, num_experts, top_k)
    out = assert_all_agree(x, w13, w2, weights, ids)
    if num_tokens:
        assert out.abs().max() > 0.1  # experts actually contributed


def test_loop_ref_matches_hf_qwen3_moe_experts() -> None:
    num_experts, top_k = 8, 2
    # "eager": HF's own per-expert loop, not one of its kernel integrations
    cfg = SimpleNamespace(num_experts=num_experts, hidden_size=HIDDEN, moe_intermediate_size=INTER,
                          hidden_act="silu", _experts_implementation="eager")
    hf = Qwen3MoeExperts(cfg)
    w13, w2 = make_experts(num_experts)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        x, weights, ids = make_routing(21, num_experts, top_k)
        expected = hf(x, ids, weights)
    torch.testing.assert_close(moe_loop_ref(x, w13, w2, weights, ids), expected)


def test_some_experts_get_no_tokens() -> None:
    w13, w2 = make_experts(8)
    x, _, _ = make_routing(11, 8, 2)
    ids = torch.tensor([[0, 3], [3, 0]] * 5 + [[6, 3]])  # experts 1, 2, 4, 5, 7 idle
    weights = torch.rand(11, 2)  # need not sum to 1
    assert_all_agree(x, w13, w2, weights, ids)


def test_all_tokens_to_one_expert() -> None:
    w13, w2 = make_experts(64)
    x, weights, _ = make_routing(33, 64, 1)
    ids = torch.full((33, 1), 5)
    out = assert_all_agree(x, w13, w2, weights, ids)
    gate_up = x @ w13[5].T
    expected = (torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]) @ w2[5].T
    torch.testing.assert_close(out, expected * weights)


def test_int32_ids_are_accepted() -> None:
    w13, w2 = make_experts(8)
    x, weights, ids = make_routing(7, 8, 2)
    torch.testing.assert_close(moe_grouped_mm(x, w13, w2, weights, ids.int()),
                               moe_loop_ref(x, w13, w2, weights, ids))


def test_bf16_grouped_mm_close_to_fp32_ref() -> None:
    w13, w2 = make_experts(64)
    x, weights, ids = make_routing(33, 64, 8)
    expected = moe_loop_ref(x, w13, w2, weights, ids)
    out = moe_grouped_mm(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_grouped_mm_runs_without_reading_device_values() -> None:
    # meta tensors hold no data: any host read (.item(), nonzero, bincount...) would raise
    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    ids = torch.empty(9, 2, dtype=torch.int64, device="meta")
    weights = torch.empty(9, 2, device="meta")
    out = moe_grouped_mm(meta(9, HIDDEN), meta(8, 2 * INTER, HIDDEN), meta(8, HIDDEN, INTER),
                         weights, ids)
    assert out.shape == (9, HIDDEN)


def test_grouped_mm_rejects_unaligned_widths() -> None:
    w13 = torch.randn(8, 2 * 12, HIDDEN, dtype=torch.bfloat16)  # I = 12: 24 bytes in bf16
    w2 = torch.randn(8, HIDDEN, 12, dtype=torch.bfloat16)
    x, weights, ids = make_routing(3, 8, 2)
    with pytest.raises(ValueError, match="multiples of 8"):
        moe_grouped_mm(x.bfloat16(), w13, w2, weights, ids)
