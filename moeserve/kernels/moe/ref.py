"""MoE experts, torch references: the per-expert loop (ground truth) and a dense vectorised one.

Both compute, for every token t and each of its k routed experts e = topk_ids[t, i]:

    out[t] += topk_weights[t, i] * (silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)) @ w2[e].T
    w13[e] = [gate_e; up_e]: [2I, H] (gate = first I rows, up = last I rows),  w2[e]: [H, I]

as Hugging Face's Qwen3-MoE / Mixtral experts do, with the routing weight cast to x's dtype
before the multiply. An id of -1 (expert parallelism: that pair's expert is on another rank)
contributes exactly zero and is computed by no expert, whatever its weight. `moe_loop_ref` is
the "torch" MoE backend (it reads which experts were hit on the host, so it syncs);
`moe_dense_ref` runs every token through every expert and is only for small tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_loop_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 reduce: bool = True) -> torch.Tensor:
    """Per-expert loop over the experts that received tokens.

    Args:
        x: [T, H].
        w13: [E, 2I, H], x's dtype.
        w2: [E, H, I], x's dtype.
        topk_weights: [T, k] float32.
        topk_ids: [T, k] integer expert ids in [0, E), or -1: not on this rank (adds zero).
        reduce: False returns [T, 1, H] (the backends' contract: parts whose sum over dim 1 is
            the result; this loop adds the k rows itself).
    Returns:
        [T, H] in x's dtype ([T, 1, H] with reduce False).
    """
    inter = w2.shape[-1]
    out = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(topk_ids).tolist():
        if e < 0:  # -1: the pair's expert is on another rank
            continue
        token_idx, slot = torch.where(topk_ids == e)  # [n_e] each
        gate_up = x[token_idx] @ w13[e].T  # [n_e, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n_e, I]
        y = act @ w2[e].T  # [n_e, H]
        y = y * topk_weights[token_idx, slot, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out if reduce else out.unsqueeze(1)


def moe_dense_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, weighted by a dense [T, E] routing matrix.

    Same contract as `moe_loop_ref` (ids -1 add zero); memory is T * E * 2I, so only for small
    tests.
    """
    num_tokens, num_experts, inter = x.shape[0], w13.shape[0], w2.shape[-1]
    routing = torch.zeros(num_tokens, num_experts, dtype=topk_weights.dtype,
                          device=x.device)  # [T, E]
    local = topk_ids >= 0  # [T, k]; -1 pairs add a zero weight to expert 0
    routing.scatter_add_(1, topk_ids.long().clamp(min=0), torch.where(local, topk_weights, 0.0))
    gate_up = torch.einsum("th,eoh->teo", x, w13)  # [T, E, 2I]
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [T, E, I]
    y = torch.einsum("tei,ehi->teh", act, w2)  # [T, E, H]
    return torch.einsum("teh,te->th", y, routing.to(x.dtype))  # [T, H]
