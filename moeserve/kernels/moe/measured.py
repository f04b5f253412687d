"""The "measured" MoE backend: per token count, the backend the tune measured faster there.

Owns `moe_measured` (same contract as `moe_loop_ref`). The tuner (`moe_tune.tune_moe`) times
the best Triton tile config and torch._grouped_mm at each tuned token count and records the
faster as the entry's "backend". Each call here takes the entry whose token count is nearest
x.shape[0] (ties: the smaller; `moe_configs.get_moe_config`) and runs

    backend "triton"      -> moe_triton(..., config=<the entry's tiles>)
    backend "grouped_mm"  -> moe_grouped_mm(...)
    no tuned file         -> moe_triton with the in-code default tiles
    tiles="default"       -> the same: no file is read, so nothing was measured, and a default
                             choice's backend is "triton" (the engine's moe_tiles=default)

The pick reads only host metadata (shapes, dtype, device): no device value, so no sync, and
inside a CUDA graph the token count is static, so each captured graph runs one backend. Picks
are cached per (device, dtype, E, H, I, top_k, tiles, routed experts) and token count, so two
engines in one process with different tile sources never share one: after the first call at a
size a call
costs a couple of dict lookups (it runs once per MoE layer per step). `moe_configs.
clear_caches()` (called after every tune) forgets them.
"""

from __future__ import annotations

import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm

# (device, dtype, E, H, I, top_k, tiles, routed experts) -> {num_tokens: (backend, tiles)}
_PLANS: dict[tuple, dict[int, tuple[str, dict[str, int]]]] = {}
moe_configs.register_cache(_PLANS.clear)


def moe_measured(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 tiles: str = "tuned", reduce: bool = True,
                 routed_experts: int | None = None) -> torch.Tensor:
    """Routed experts through the backend measured faster at this token count.

    Args and result as `moe_triton` / `moe_grouped_mm`: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, k] float32, topk_ids [T, k] (ids in [0, E), or -1: not on this rank, a
    pair that both backends skip and that adds zero) -> [T, H] in x's dtype (reduce False:
    [T, k, H], the k weighted rows unsummed, a -1 pair's row 0). tiles: "tuned" (the tune's
    picks) or "default" (Triton with the in-code default tiles at every size), as
    `moe_configs.get_moe_config` takes it. routed_experts: as `moe_triton`'s (expert
    parallelism: the picks at `moe_configs.tile_tokens`' count).
    """
    shape_key = (x.device, x.dtype, w13.shape[0], w13.shape[2], w2.shape[2], topk_ids.shape[1],
                 tiles, routed_experts)
    plans = _PLANS.get(shape_key)
    if plans is None:
        plans = _PLANS[shape_key] = {}
    num_tokens = x.shape[0]
    plan = plans.get(num_tokens)
    if plan is None:
        plan = plans[num_tokens] = pick(shape_key, num_tokens)
    backend, config = plan
    if backend == "grouped_mm":
        return moe_grouped_mm(x, w13, w2, topk_weights, topk_ids, reduce=reduce)
    return moe_triton(x, w13, w2, topk_weights, topk_ids, config=config, reduce=reduce)


def pick(shape_key: tuple, num_tokens: int) -> tuple[str, dict[str, int]]:
    """(backend, Triton tiles) for one shape key and token count, from the tuned files (or
    the defaults, as the key's tile source says)."""
    device, dtype, num_experts, hidden, inter, top_k, tiles, routed = shape_key
    choice = moe_configs.get_moe_config(
        num_experts, hidden, inter, top_k, dtype,
        moe_configs.tile_tokens(num_tokens, num_experts, routed),
        moe_configs.tile_device_name(device), tiles=tiles)
    backend = choice.backend if num_tokens > 0 else "triton"  # moe_triton returns [0, H] at once
    return backend, choice.config

