"""select_experts against Hugging Face's own Qwen3-MoE and Mixtral routers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moeserve.kernels.routing import select_experts

HIDDEN = 32


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 1), (8, 2), (64, 8)])
def test_matches_hf_qwen3_moe_router(num_experts: int, top_k: int, renormalize: bool) -> None:
    cfg = SimpleNamespace(num_experts_per_tok=top_k, num_experts=num_experts,
                          norm_topk_prob=renormalize, hidden_size=HIDDEN)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(33, HIDDEN)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)


def test_matches_hf_mixtral_router() -> None:
    cfg = SimpleNamespace(num_experts_per_tok=2, num_local_experts=8, hidden_size=HIDDEN)
    router = MixtralTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(torch.randn(17, HIDDEN))
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    # Mixtral's renormalised weights equal a softmax over the top-k logits
    torch.testing.assert_close(weights, logits.gather(1, ids).softmax(dim=-1))


def test_renormalised_weights_sum_to_one() -> None:
    logits = torch.randn(40, 64, dtype=torch.bfloat16)
    weights, _ = select_experts(logits, 8, renormalize=True)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(40))


def test_unnormalised_weights_are_the_softmax_probabilities() -> None:
    logits = torch.randn(9, 16)
    weights, ids = select_experts(logits, 4, renormalize=False)
    probs = logits.softmax(dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert (weights[:, :-1] >= weights[:, 1:]).all()  # descending
    assert (weights.sum(dim=-1) < 1).all()


def test_ties_break_like_topk_on_fp32_probabilities() -> None:
    # integer logits: many exactly tied experts per row
    logits = torch.randint(0, 3, (64, 16)).to(torch.bfloat16)
    weights, ids = select_experts(logits, 4, renormalize=True)
    hf_probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    hf_weights, hf_ids = torch.topk(hf_probs, 4, dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights / hf_weights.sum(dim=-1, keepdim=True))


def test_runs_without_reading_device_values() -> None:
    # meta tensors hold no data: any host read (.item(), nonzero, ...) would raise
    weights, ids = select_experts(torch.empty(5, 8, device="meta"), 2, renormalize=True)
    assert weights.shape == ids.shape == (5, 2)
