"""The sigmoid, group-limited router of DeepSeek-V3 / GLM / Kimi in one Triton launch, with the
expert-load count fused in (as select_triton.py does for the softmax router).

Owns `select_experts_grouped_triton`: the contract of `routing.select_experts_grouped`
(transformers' DeepseekV3TopkRouter), plus `counts[e] += mask[t]` for every chosen (token t,
expert e) when expert load is collected. Unfused that is a dozen small kernels a MoE layer
(sigmoid, the bias add, the groups' top-2 and top-k with their scatter and masked fill, the
experts' top-k, the gather, the sum, the divide, the scale, the count's scatter_add): at
GLM-4.7-Flash's 46 MoE layers a few milliseconds of a step of launches each about as costly
as its work.

`_route_sigmoid_kernel`: one program per BLOCK_T tokens, a token's E scores in registers:
    p = sigmoid(x)                         fp32; c = p + bias (the choice only)
    groups (G > 1 and kept < G): each group's score is the sum of its two best c (its best
    alone for one expert a group); the `kept` best groups stay, the others' c become -inf
    K times: v = max(c); i = lowest index with c == v; record (p[i], i); c[i] = -inf
    renormalise: w = p / (sum(p) + 1e-20); w *= scaling; counts[i] += mask[t]
Ties pick the lowest index, groups and experts alike (torch.topk's order among exactly equal
values is not specified). sigmoid may differ from torch's by an ulp, so a choice between two
experts whose scores are that close can differ (tests bound it).

NOTE: CUDA-graph capturable: no host sync, the grid depends on shapes only. Triton is imported
on first use (`_kernels`); on CPU the kernel runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.routing import select_triton
from moeserve.kernels.routing.select import _check_grouped
from moeserve.kernels.triton_common import next_pow2

BLOCK_T = select_triton.BLOCK_T  # tokens a program, halved past 256 experts a token: at
# Kimi's 384 (512 padded) sixteen tokens spilled 108 bytes (sm90, ptxas); eight spill none
tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global
_max: Any = None  # select_triton's jitted helpers, bound by _kernels() too
_min: Any = None
_take_top_k: Any = None


def grouped_supported(num_experts: int, num_groups: int, topk_groups: int) -> bool:
    """Whether the kernel takes this router: at most MAX_EXPERTS experts, and with group
    limiting (num_groups > 1, topk_groups < num_groups) power-of-two groups of power-of-two
    experts (DeepSeek-V3's 8 groups of 32); otherwise routing.select_experts_grouped runs."""
    if not 0 < num_experts <= select_triton.MAX_EXPERTS:
        return False
    if num_groups <= 1 or topk_groups >= num_groups:
        return True
    per_group = num_experts // num_groups

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0
    return num_experts % num_groups == 0 and pow2(num_groups) and pow2(per_group)


def select_experts_grouped_triton(router_logits: torch.Tensor, top_k: int, *,
                                  num_groups: int = 1, topk_groups: int = 1,
                                  correction_bias: torch.Tensor | None = None,
                                  renormalize: bool = True, scaling_factor: float = 1.0,
                                  counts: torch.Tensor | None = None,
                                  count_mask: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts_grouped` in one launch, optionally counting the chosen experts (counts,
    count_mask as `select_experts_triton`'s). Returns topk_weights [T, k] float32 and
    topk_ids [T, k] int64, each row in the order chosen (largest biased score first)."""
    num_tokens, num_experts = _check_grouped(router_logits, top_k, num_groups, topk_groups,
                                             correction_bias)
    select_triton._check(router_logits, top_k, counts, count_mask)
    if not grouped_supported(num_experts, num_groups, topk_groups):
        raise ValueError(f"select_experts_grouped_triton: {num_experts} experts in "
                         f"{num_groups} groups ({topk_groups} kept) need power-of-two groups "
                         "of power-of-two experts (grouped_supported)")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    limit = num_groups > 1 and topk_groups < num_groups
    bias = correction_bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    e_pow2 = next_pow2(num_experts)
    block_t = max(1, BLOCK_T * 256 // max(256, e_pow2))
    _kernels().route[(-(-num_tokens // block_t),)](
        router_logits, bias if bias is not None else weights, weights, ids,
        counts if counts is not None else ids, count_mask if count_mask is not None else ids,
        num_tokens, router_logits.stride(0), float(scaling_factor),
        E=num_experts, E_POW2=e_pow2, K=top_k, K_POW2=next_pow2(top_k),
        G=num_groups if limit else 1, KEPT=topk_groups if limit else 1, BLOCK_T=block_t,
        HAS_BIAS=bias is not None, RENORMALIZE=renormalize, COUNT=counts is not None,
        HAS_MASK=count_mask is not None, num_warps=4)
    return weights, ids


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _max, _min, _take_top_k
    import triton
    import triton.language

    select_triton._kernels()
    tl = triton.language
    _max, _min, _take_top_k = select_triton._max, select_triton._min, select_triton._take_top_k
    # the token count changes every step: no variant per value (paged_attention_triton.py)
    return SimpleNamespace(route=triton.jit(_route_sigmoid_kernel,
                                            do_not_specialize=["num_tokens"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _route_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr, mask_ptr,
                          num_tokens, stride_t, scaling, E: tl.constexpr, E_POW2: tl.constexpr,
                          K: tl.constexpr, K_POW2: tl.constexpr, G: tl.constexpr,
                          KEPT: tl.constexpr, BLOCK_T: tl.constexpr, HAS_BIAS: tl.constexpr,
                          RENORMALIZE: tl.constexpr, COUNT: tl.constexpr,
                          HAS_MASK: tl.constexpr):
    """Tokens pid * BLOCK_T .. + BLOCK_T: sigmoid scores, group limit (G > 1), top K by the
    biased scores, the unbiased weights renormalised and scaled, ids, counts."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = rows < num_tokens
    cols = tl.arange(0, E_POW2)  # [EP]
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    p = tl.sigmoid(x)  # [BT, EP]
    c = p
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    c = tl.where(col_ok[None, :], c, float("-inf"))  # padded experts: never chosen
    if G > 1:  # E == E_POW2 here (grouped_supported): [BT, G, E / G]
        PG: tl.constexpr = E // G
        grouped = tl.reshape(c, [BLOCK_T, G, PG])
        inner = tl.arange(0, PG)[None, None, :]
        best = _max(grouped, 2)  # [BT, G]
        if PG > 1:  # plus the second best (the best's first index masked)
            first = _min(tl.where(grouped == best[:, :, None], inner, PG), 2)
            second = _max(tl.where(inner == first[:, :, None], float("-inf"), grouped), 2)
            best = best + second
        gcols = tl.arange(0, G)[None, :]
        keep = tl.zeros((BLOCK_T, G), dtype=tl.int32)
        for _ in tl.static_range(KEPT):  # the KEPT best groups, lowest index on ties
            top = _max(tl.where(keep != 0, float("-inf"), best), 1)
            pick = _min(tl.where((best == top[:, None]) & (keep == 0), gcols, G), 1)
            keep = keep | (gcols == pick[:, None]).to(tl.int32)
        c = tl.reshape(tl.where(keep[:, :, None] != 0, grouped, float("-inf")),
                       [BLOCK_T, E_POW2])
    # the K best by the biased score, weighted by the unbiased one; -inf below every candidate
    _take_top_k(c, p, cols, rows, row_ok, weights_ptr, ids_ptr, counts_ptr, mask_ptr,
                float("-inf"), 1e-20, scaling, E_POW2, K, K_POW2, BLOCK_T, RENORMALIZE, COUNT,
                HAS_MASK, False)
