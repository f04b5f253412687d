"""MoE experts through `torch._grouped_mm`: the fast default, with no host sync.

Owns `moe_grouped_mm`. Data flow, for T tokens, k experts each, M = T * k (token, slot) pairs:

    topk_ids [T, k] --flatten, -1 -> E, stable sort--> order [M]   (pair order[m] is m-th sorted)
    x [T, H] --gather rows order // k--> x_sorted [M, H]
    counts [E] = zeros.scatter_add_(ids)  ->  offs [E] = cumsum(counts) (int32, group ends)
    x_sorted @ w13[e].T per group  ->  [M, 2I]  ->  silu(gate) * up  ->  [M, I]
             @ w2[e].T per group   ->  [M, H]   ->  * routing weight  ->  [M + 1, H] (row M: 0)
             ->  un-sort (gather each pair's sorted row), [T, k, H].sum(1)

An id of -1 (expert parallelism: the pair's expert is on another rank) sorts after every
expert's group, past offs[-1], where no GEMM computes a row: those rows of the GEMMs' outputs are
undefined (garbage, NaN even) and are never read. The un-sort gathers, for such a pair, the
extra zero row M instead, so its part row is exactly 0 (no multiply by a zero weight, which
would keep a NaN) at no extra pass over [M, H].

Nothing reads a device value on the host (no .item(), .tolist(), nonzero or bincount), so the
op can sit inside a captured CUDA graph.

`torch._grouped_mm` constraints (torch >= 2.11):
- CPU: fp32, bf16 and fp16. CUDA: bf16 on sm90/sm100 runs the fused CUTLASS kernel; any other
  dtype or GPU takes a per-group fallback that copies `offs` to the host (a sync).
- Every matrix needs unit stride in one of its last two dims and the other stride a multiple of
  16 bytes: H and I multiples of 8 in bf16/fp16 (4 in fp32).
- The weights are read as `w13.transpose(-2, -1)` ([E, H, 2I], column-major): a view of the
  checkpoint layout, no copy per call. It requires w13 and w2 contiguous in their last two dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   reduce: bool = True) -> torch.Tensor:
    """Routed experts as two grouped GEMMs over expert-sorted (token, slot) pairs.

    Args:
        x: [T, H], contiguous.
        w13: [E, 2I, H] (gate rows then up rows), x's dtype, last dim contiguous.
        w2: [E, H, I], x's dtype, last dim contiguous.
        topk_weights: [T, k] float32 (cast to x's dtype before the multiply, as HF does).
        topk_ids: [T, k] integer expert ids in [0, E), or -1: not on this rank (no GEMM row,
            a zero part row, adds nothing).
        reduce: False returns the k weighted rows [T, k, H] unsummed (the caller's norm adds
            them: `rms_norm_triton` parts).
    Returns:
        [T, H] in x's dtype ([T, k, H] with reduce False).
    """
    _check_inputs(x, w13, w2, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w13.shape[0], topk_ids.shape[1], w2.shape[-1]
    num_pairs = num_tokens * top_k
    flat_ids = topk_ids.reshape(-1).long()  # [M]
    flat_ids = flat_ids.masked_fill(flat_ids < 0, num_experts)  # -1 (not on this rank) -> E
    _, order = torch.sort(flat_ids, stable=True)  # [M], pair index of each sorted row
    x_sorted = x.index_select(0, order // top_k)  # [M, H]
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)  # [E + 1]
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], dim=0).to(torch.int32)  # [E], group end rows

    gate_up = torch._grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offs)  # [M, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [M, I]
    y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)  # [M, H], past offs[-1] undefined
    weighted = y.new_empty(num_pairs + 1, hidden)  # [M + 1, H]: row M is the -1 pairs' zero row
    torch.mul(y, topk_weights.reshape(-1)[order].to(x.dtype)[:, None], out=weighted[:num_pairs])
    weighted[num_pairs:].zero_()
    arange = torch.arange(num_pairs, device=x.device)
    row = torch.empty_like(order).scatter_(0, order, arange)  # [M], each pair's sorted row
    row = row.masked_fill(flat_ids == num_experts, num_pairs)  # -1 pairs read the zero row
    parts = weighted.index_select(0, row).view(num_tokens, top_k, hidden)  # [T, k, H]
    return parts.sum(dim=1) if reduce else parts


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids: torch.Tensor) -> None:
    """Shape, dtype and stride checks (host metadata only, no sync)."""
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    assert x.dim() == 2 and x.shape[1] == hidden and x.is_contiguous(), (x.shape, w13.shape)
    assert w2.shape == (num_experts, hidden, inter), (w13.shape, w2.shape)
    assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], (topk_ids.shape, x.shape)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights need a contiguous last dim"
    align = 16 // x.element_size()
    if hidden % align or inter % align:
        raise ValueError(f"torch._grouped_mm needs hidden ({hidden}) and expert width ({inter}) "
                         f"to be multiples of {align} for {x.dtype}; use moe_backend='torch'")
