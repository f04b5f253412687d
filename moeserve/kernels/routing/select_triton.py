"""The softmax top-k router in one Triton launch, with the expert-load count fused in.

Owns `select_experts_triton`: the same contract as `routing.select_experts` (softmax in fp32 over
all experts, the k largest probabilities, optional renormalisation), plus what the MoE block
does right after it when expert load is collected: `counts[e] += mask[t]` for every chosen
(token t, expert e). Unfused that is six small kernels a layer (softmax, topk, sum, divide, the
mask's copy, scatter_add); at decode sizes each costs about as much as its launch.

`_route_kernel`: one program per BLOCK_T tokens; a token's E logits live in registers:
    p = exp(x - max) / sum                       fp32, as torch.softmax
    k times: v = max(p); i = lowest index with p == v; record (v, i); p[i] = -1
    renormalise: w = v / sum(v)                  (the k values, largest first)
    counts[i] += mask[t] (int64 atomics)         when counting
Ties pick the lowest expert index; torch.topk's order among exactly equal probabilities is not
specified. exp and the sums may differ from torch's by a few fp32 ulps, so a choice between two
experts whose probabilities are that close can differ (tests bound it).

NOTE: CUDA-graph capturable: no host sync, the grid depends on shapes only. Triton is imported
on first use (`_kernels`); on CPU the kernel runs only under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from moeserve.kernels.triton_common import next_pow2, require_triton_device

MAX_EXPERTS = 1024  # one token's logits live in registers
BLOCK_T = 16  # tokens per program
tl: Any = None  # triton.language, bound by _kernels(): the kernel reads it as a global


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                          counts: torch.Tensor | None = None,
                          count_mask: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in one launch, optionally counting the chosen experts.

    Args:
        router_logits: [T, E] float (any float dtype), unit stride on the last dimension.
        top_k: experts per token, 1..E.
        renormalize: rescale the k weights to sum to 1.
        counts: None, or [E] int64 (contiguous) that gets += 1 per chosen expert of each token
            (+= count_mask[t] when count_mask is given).
        count_mask: None, or [T] int64 (1 = a real token, 0 = padding); only with counts.
    Returns:
        topk_weights [T, k] float32 (largest first), topk_ids [T, k] int64.
    """
    _check(router_logits, top_k, counts, count_mask)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    grid = (-(-num_tokens // BLOCK_T),)
    _kernels().route[grid](
        router_logits, weights, ids, counts if counts is not None else ids,
        count_mask if count_mask is not None else ids, num_tokens, router_logits.stride(0),
        E=num_experts, E_POW2=next_pow2(num_experts), K=top_k, K_POW2=next_pow2(top_k),
        BLOCK_T=BLOCK_T, RENORMALIZE=renormalize, COUNT=counts is not None,
        HAS_MASK=count_mask is not None, num_warps=4)
    return weights, ids


def _check(logits: torch.Tensor, top_k: int, counts: torch.Tensor | None,
           count_mask: torch.Tensor | None) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"select_experts_triton: {what}")

    need(logits.dim() == 2 and logits.is_floating_point(),
         f"router_logits must be a float [T, E], got {tuple(logits.shape)} {logits.dtype}")
    num_tokens, num_experts = logits.shape
    need(0 < num_experts <= MAX_EXPERTS, f"E must be in 1..{MAX_EXPERTS}, got {num_experts}")
    need(logits.stride(1) == 1 or num_experts == 1, "router_logits needs a unit last stride")
    need(1 <= top_k <= num_experts, f"top_k must be in 1..{num_experts}, got {top_k}")
    if counts is not None:
        need(counts.shape == (num_experts,) and counts.dtype == torch.int64
             and counts.is_contiguous() and counts.device == logits.device,
             f"counts must be a contiguous int64 [{num_experts}] on {logits.device}, got "
             f"{tuple(counts.shape)} {counts.dtype} on {counts.device}")
    if count_mask is not None:
        need(counts is not None, "count_mask without counts")
        need(count_mask.shape == (num_tokens,) and count_mask.dtype == torch.int64
             and count_mask.is_contiguous() and count_mask.device == logits.device,
             f"count_mask must be a contiguous int64 [{num_tokens}], got "
             f"{tuple(count_mask.shape)} {count_mask.dtype}")
    require_triton_device(logits.device, "select_experts_triton")


@functools.cache
def _kernels() -> SimpleNamespace:
    """Import triton and jit the kernel, once (interpreted if TRITON_INTERPRET=1 now)."""
    global tl, _max, _min, _sum, _take_top_k
    import triton
    import triton.language

    tl = triton.language
    _max, _min, _sum = triton.jit(_max), triton.jit(_min), triton.jit(_sum)
    _take_top_k = triton.jit(_take_top_k)
    # the token count changes every step: no variant per value (paged_attention_triton.py)
    return SimpleNamespace(route=triton.jit(_route_kernel, do_not_specialize=["num_tokens"]))


# ---- Triton kernel (jitted by _kernels; pointer arguments are untyped, as Triton expects) ----

def _max(x, AXIS: tl.constexpr):
    """Max over AXIS, as tl.max but without its own jit wrapper, so it also runs in the
    interpreter when triton was imported before TRITON_INTERPRET=1 was set."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


def _min(x, AXIS: tl.constexpr):
    """Min over AXIS (see _max)."""
    return tl.reduce(x, AXIS, tl.standard._elementwise_min)


def _sum(x, AXIS: tl.constexpr):
    """Sum over AXIS (see _max)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


def _route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, mask_ptr, num_tokens, stride_t,
                  E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                  BLOCK_T: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr,
                  HAS_MASK: tl.constexpr):
    """Tokens pid * BLOCK_T .. + BLOCK_T: softmax over E, top K, weights, ids, counts."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = rows < num_tokens
    cols = tl.arange(0, E_POW2)  # [EP]
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: any finite values
    p = tl.exp(x - _max(x, 1)[:, None])
    p = tl.where(col_ok[None, :], p, 0.0)
    probs = p / _sum(p, 1)[:, None]  # [BT, EP]
    probs = tl.where(col_ok[None, :], probs, -1.0)  # never chosen
    _take_top_k(probs, probs, cols, rows, row_ok, weights_ptr, ids_ptr, counts_ptr, mask_ptr,
                -1.0, 0.0, 1.0, E_POW2, K, K_POW2, BLOCK_T, RENORMALIZE, COUNT, HAS_MASK, True)


def _take_top_k(choice, value, cols, rows, row_ok, weights_ptr, ids_ptr, counts_ptr, mask_ptr,
                FILL: tl.constexpr, EPS: tl.constexpr, scaling, E_POW2: tl.constexpr,
                K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_T: tl.constexpr,
                RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, HAS_MASK: tl.constexpr,
                VALUE_IS_CHOICE: tl.constexpr):
    """The K largest of choice [BT, EP] a row (the lowest index on ties; a pick is set to FILL,
    below every candidate), their `value`s as the weights (w / (sum + EPS) when RENORMALIZE,
    then times scaling), stored at weights / ids rows [T, K]; counts[pick] += mask[t] (or 1)
    when COUNT. Shared by the softmax and the sigmoid routers (grouped_triton.py).
    VALUE_IS_CHOICE: value is choice (the softmax's), so a weight is the row's max itself, not
    one more reduction (sm90: 1,520 instructions at 128 experts and k 8, against 1,912)."""
    kcols = tl.arange(0, K_POW2)  # [KP]
    top_w = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int64)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if HAS_MASK:
        weight = tl.load(mask_ptr + rows, mask=row_ok, other=0)
    else:
        weight = tl.full((BLOCK_T,), 1, tl.int64)
    for i in tl.static_range(K):
        best = _max(choice, 1)  # [BT]
        pick = _min(tl.where(choice == best[:, None], cols[None, :], E_POW2), 1)  # lowest index
        chosen = cols[None, :] == pick[:, None]
        if VALUE_IS_CHOICE:
            w = best
        else:
            w = _sum(tl.where(chosen, value, 0.0), 1)  # [BT]: the one chosen value, exactly
        top_w = tl.where(kcols[None, :] == i, w[:, None], top_w)
        top_i = tl.where(kcols[None, :] == i, pick[:, None].to(tl.int64), top_i)
        total += w
        choice = tl.where(chosen, FILL, choice)
        if COUNT:
            tl.atomic_add(counts_ptr + pick, weight, mask=row_ok, sem="relaxed")
    if RENORMALIZE:
        top_w = top_w / (total[:, None] + EPS)
    top_w = top_w * scaling
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    ok = row_ok[:, None] & (kcols[None, :] < K)
    tl.store(weights_ptr + out, top_w, mask=ok)
    tl.store(ids_ptr + out, top_i, mask=ok)
