"""MoE routing: router logits -> each token's top-k experts and their weights.

Owns `select_experts`, the softmax top-k router of Qwen3-MoE and Mixtral, computed exactly as
Hugging Face computes it (softmax in fp32 over all experts, `torch.topk` on those probabilities,
optional renormalisation), so that expert choice and tie-breaking match token for token.
Grouped routing (DeepSeek-V3 / GLM) will be a separate function here.
"""

from __future__ import annotations

import torch


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
