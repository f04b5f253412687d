"""select_experts against Hugging Face's own Qwen3-MoE and Mixtral routers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moeserve.kernels.routing.select import router_logits_fp32, select_experts

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


# ---- the grouped sigmoid router (DeepSeek-V3, GLM-4.5 MoE) -------------------------------------

def hf_grouped_router(num_experts: int, top_k: int, groups: int, topk_groups: int,
                      renormalize: bool, scaling: float) -> torch.nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = SimpleNamespace(num_experts_per_tok=top_k, num_local_experts=num_experts,
                          hidden_size=HIDDEN, routed_scaling_factor=scaling, n_group=groups,
                          topk_group=topk_groups, norm_topk_prob=renormalize)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(std=0.2)
    return router


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (expert, weight) pairs sorted by expert (topk(sorted=False) has no order)."""
    ids_sorted, order = ids.sort(dim=1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize(("num_experts", "top_k", "groups", "topk_groups"),
                         [(16, 4, 1, 1), (16, 4, 4, 2), (64, 8, 8, 4), (32, 6, 8, 3)])
@pytest.mark.parametrize(("renormalize", "scaling"), [(True, 2.5), (False, 1.0)])
def test_grouped_matches_hf_deepseek_v3_router(num_experts: int, top_k: int, groups: int,
                                               topk_groups: int, renormalize: bool,
                                               scaling: float) -> None:
    from moeserve.kernels.routing.select import select_experts_grouped

    router = hf_grouped_router(num_experts, top_k, groups, topk_groups, renormalize, scaling)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(torch.randn(29, HIDDEN))
        weights, ids = select_experts_grouped(
            logits, top_k, num_groups=groups, topk_groups=topk_groups,
            correction_bias=router.e_score_correction_bias, renormalize=renormalize,
            scaling_factor=scaling)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    w, i = by_expert(weights, ids)
    hf_w, hf_i = by_expert(hf_weights, hf_ids)
    assert torch.equal(i, hf_i)
    torch.testing.assert_close(w, hf_w)
    # the bias steers the choice but not the weights
    unbiased = logits.sigmoid().gather(1, ids)
    if renormalize:
        unbiased = unbiased / unbiased.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, unbiased * scaling)


def test_grouped_rows_use_at_most_topk_groups() -> None:
    from moeserve.kernels.routing.select import select_experts_grouped

    logits = torch.randn(200, 64)
    _, ids = select_experts_grouped(logits, 8, num_groups=8, topk_groups=2)
    groups_per_row = [len(set((row // 8).tolist())) for row in ids]
    assert max(groups_per_row) <= 2


def test_grouped_without_host_reads_and_bad_arguments() -> None:
    from moeserve.kernels.routing.select import select_experts_grouped

    weights, ids = select_experts_grouped(torch.empty(5, 16, device="meta"), 4, num_groups=4,
                                          topk_groups=2,
                                          correction_bias=torch.empty(16, device="meta"))
    assert weights.shape == ids.shape == (5, 4)
    logits = torch.randn(3, 16)
    for kwargs, message in [({"num_groups": 5}, "must divide the 16 experts"),
                            ({"num_groups": 4, "topk_groups": 5}, "topk_groups \\(5\\)"),
                            ({"num_groups": 4, "topk_groups": 1, "top_k": 5},
                             "top_k \\(5\\) must be in 1..4"),
                            ({"correction_bias": torch.zeros(8)}, "correction_bias must be"),
                            ({"top_k": 0}, "top_k \\(0\\)")]:
        args = {"top_k": 4} | kwargs
        with pytest.raises(ValueError, match=message):
            select_experts_grouped(logits, **args)
    with pytest.raises(ValueError, match="router_logits must be a float"):
        select_experts_grouped(torch.zeros(3, 16, dtype=torch.int64), 2)


@pytest.mark.gpu
def test_gpu_grouped_router_has_no_host_sync() -> None:
    from moeserve.kernels.routing.select import select_experts_grouped

    logits = torch.randn(1024, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weights, ids = select_experts_grouped(logits, 8, num_groups=8, topk_groups=4,
                                              correction_bias=bias, scaling_factor=2.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected_w, expected_i = select_experts_grouped(logits.cpu(), 8, num_groups=8, topk_groups=4,
                                                    correction_bias=bias.cpu(),
                                                    scaling_factor=2.5)
    w, i = by_expert(weights.cpu(), ids.cpu())
    ew, ei = by_expert(expected_w, expected_i)
    assert torch.equal(i, ei)
    torch.testing.assert_close(w, ew)


def test_router_logits_fp32_off_cuda_is_the_fp32_gemm() -> None:
    """DeepSeek / GLM's fp32 router logits: on CPU both operands cast to fp32, as HF does."""
    x, gate = torch.randn(5, HIDDEN).bfloat16(), torch.randn(4, HIDDEN).bfloat16()
    logits = router_logits_fp32(x, gate)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x.float(), gate.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_router_logits_fp32_from_half_inputs(dtype: torch.dtype) -> None:
    """On CUDA half inputs take one tensor-core GEMM with fp32 output: exact products summed
    in fp32, so within fp32 roundings of the sums of |products| of the fp32 GEMM's logits."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1024, 2048, generator=gen, device="cuda").to(dtype)
    gate = torch.randn(64, 2048, generator=gen, device="cuda").to(dtype)
    logits = router_logits_fp32(x, gate)
    exact = x.double() @ gate.double().T
    assert logits.dtype == torch.float32
    tol = 1e-5 * (x.double().abs() @ gate.double().abs().T)
    assert bool(((logits.double() - exact).abs() <= tol).all())
    graph_out = torch.empty_like(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capturable: the engine's decode graphs run it
        graph_out.copy_(router_logits_fp32(x, gate))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, logits)
