"""MoE routing: router logits -> each token's top-k experts and their weights.

Owns the two routers, each computed exactly as Hugging Face computes it, with no host sync:
- `select_experts`: the softmax top-k router of Qwen3-MoE and Mixtral (softmax in fp32 over all
  experts, `torch.topk` on those probabilities, optional renormalisation), so that expert choice
  and tie-breaking match token for token;
- `select_experts_grouped`: the sigmoid router of DeepSeek-V3 and GLM-4.5 MoE, with the
  per-expert correction bias (it steers the choice, not the weights) and group-limited top-k
  (experts come from the `topk_groups` groups whose two best biased scores sum highest);
- `select_experts_softmax_grouped`: DeepSeek-V2's softmax router, greedy or group-limited
  (groups scored by their best expert), weights never renormalised, times the scaling factor.
`router_logits_fp32` computes the logits in fp32 as DeepSeek and GLM do.
"""

from __future__ import annotations

import torch


def router_logits_fp32(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ gate [E, H].T in fp32, as Hugging Face computes DeepSeek's and GLM's router
    logits (both cast to fp32 first). Half-precision inputs on CUDA go through one tensor-core
    GEMM with fp32 output: their products are exact in fp32 and summed in fp32, without the
    fp32 copies of x and of the gate and the CUDA-core fp32 GEMM (on the H200, glm-4.7-flash's
    decode step at 1,024 rows spent 0.8 ms in those GEMMs and about 0.9 ms in the copies:
    benchmarks/results/gpu_bb408cc/call7_w1_glm47_2ae848a); the sums' order differs from the
    fp32 GEMM's, by fp32 roundings. Elsewhere (CPU, fp32 models) the fp32 GEMM itself."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and gate.dtype == x.dtype:
        return torch.mm(x, gate.t(), torch.float32)  # [T, E]
    return torch.nn.functional.linear(x.float(), gate.float())


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's top-k experts by softmax probability. No host sync.

    Args:
        router_logits: [T, E], any float dtype.
        top_k: experts per token (<= E).
        renormalize: rescale the k weights to sum to 1 (Qwen3-MoE's norm_topk_prob; Mixtral
            always does, which equals a softmax over the top-k logits).
    Returns:
        topk_weights: [T, k] float32, in descending order per token.
        topk_ids: [T, k] int64; ties break as torch.topk breaks them on the fp32 probabilities.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def select_experts_grouped(router_logits: torch.Tensor, top_k: int, *, num_groups: int = 1,
                           topk_groups: int = 1, correction_bias: torch.Tensor | None = None,
                           renormalize: bool = True, scaling_factor: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, biased choice, group-limited top-k.

    As HF's DeepseekV3TopkRouter (transformers 5.17): scores = sigmoid(logits) in fp32; the
    choice uses scores + correction_bias; each of `num_groups` equal groups of experts is scored
    by the sum of its two best biased scores (its best alone when a group has one expert), the
    `topk_groups` best groups are kept and the `top_k` best experts are chosen among theirs; the
    weights are the unbiased scores of the chosen experts, renormalised (sum + 1e-20) when asked,
    times `scaling_factor`. No host sync.

    Args:
        router_logits: [T, E], any float dtype (HF computes them in fp32).
        top_k: experts per token, at most topk_groups * E / num_groups.
        num_groups, topk_groups: E splits into num_groups groups (E % num_groups == 0);
            1 <= topk_groups <= num_groups.
        correction_bias: None or [E] (any float dtype), added to the scores for the choice only.
        renormalize: divide the k weights by their sum (DeepSeek-V3's norm_topk_prob).
        scaling_factor: the routed_scaling_factor applied to the weights.
    Returns:
        topk_weights [T, k] float32 and topk_ids [T, k] int64; the order within a row is
        unspecified (as HF's `topk(sorted=False)`); the MoE sum does not depend on it.
    """
    num_tokens, num_experts = _check_grouped(router_logits, top_k, num_groups, topk_groups,
                                             correction_bias)
    scores = router_logits.float().sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1 and topk_groups < num_groups:
        per_group = num_experts // num_groups
        grouped = choice.view(num_tokens, num_groups, per_group)  # [T, G, E / G]
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()  # [T, G]
        keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    topk_weights = scores.gather(1, topk_ids)  # [T, k]
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * scaling_factor, topk_ids


def select_experts_softmax_grouped(router_logits: torch.Tensor, top_k: int, *,
                                   num_groups: int = 1, topk_groups: int = 1,
                                   scaling_factor: float = 1.0
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing, as HF's DeepseekV2TopkRouter (transformers 5.17): softmax in fp32;
    `topk_method` "greedy" is num_groups == topk_groups (every group kept); else each group is
    scored by its best probability, the `topk_groups` best groups kept (the others' experts
    zeroed) and the top_k experts chosen among them. Weights: the chosen probabilities times
    `scaling_factor` (no renormalisation). Order within a row unspecified. No host sync."""
    num_tokens, num_experts = _check_grouped(router_logits, top_k, num_groups, topk_groups,
                                             None)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    if topk_groups < num_groups:
        per_group = num_experts // num_groups
        group_scores = probs.view(num_tokens, num_groups, per_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()  # [T, G]
        keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        probs = probs.masked_fill(~keep, 0.0)
    topk_weights, topk_ids = torch.topk(probs, k=top_k, dim=-1, sorted=False)
    return topk_weights * scaling_factor, topk_ids


def _check_grouped(logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                   bias: torch.Tensor | None) -> tuple[int, int]:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"router_logits must be a float [T, E], got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    num_tokens, num_experts = logits.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the {num_experts} experts")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups ({topk_groups}) must be in 1..num_groups ({num_groups})")
    reachable = topk_groups * (num_experts // num_groups)
    if not 1 <= top_k <= reachable:
        raise ValueError(f"top_k ({top_k}) must be in 1..{reachable} (the experts of "
                         f"{topk_groups} of {num_groups} groups)")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [{num_experts}], got {tuple(bias.shape)}")
    return num_tokens, num_experts
