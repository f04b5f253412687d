"""Sparse MoE block: router, top-k selection, experts run by the chosen MoE backend.

    x [T, hidden] --gate--> router_logits [T, E] (activation dtype, as HF)
      -> select_experts(top_k, renormalize=norm_topk_prob) -> topk_weights [T, k] fp32,
                                                               topk_ids [T, k] int64
      -> moe_backend(x, w13, w2, topk_weights, topk_ids) -> [T, hidden]
         (forward(x, reduce=False): [T, S, hidden] parts, summed by the next norm; the Triton
         backend then skips its own pass over the k weighted rows)

    w13 [E, 2I, hidden]: per expert, rows [0, I) gate_proj, rows [I, 2I) up_proj
    w2  [E, hidden, I]:  per expert, down_proj

Expert load: when the runner binds `expert_counts` (a row [E] int64 of its per-layer counter),
every forward adds the tokens routed to each expert, on the device, with no host sync. A CUDA
graph's padding rows are left out through `count_mask` ([T] int64, 1 = a real token).

Routers (config.router): softmax top-k (Qwen3-MoE, Mixtral); DeepSeek-V2's softmax, greedy or
group-limited, scaled; DeepSeek-V3 / GLM's sigmoid with `e_score_correction_bias` [E] fp32 and
group-limited top-k, scaled (kernels/routing/select.py). DeepSeek and GLM compute the router
logits in fp32. On CUDA the softmax top-k routing and the count run as one Triton kernel
(kernels/routing/select_triton.py; the same ops up to a few fp32 ulps and the order of exact
ties); so does the sigmoid, group-limited router (DeepSeek-V3, GLM, Kimi:
kernels/routing/grouped_triton.py; `grouped_router_triton`; on CPU under Triton's interpreter
for the tests); the other routers and CPU run the torch references, counting with scatter_add.

Shared experts (DeepSeek, GLM): one dense MLP of width `shared_expert_intermediate_size` sees
every token beside the routed experts; its output is added into the first part of the routed
[T, S, hidden] parts (or to their sum, reduce=True). `fold_shared_experts` (the engine's flag,
after the weights are loaded) appends that MLP's weights to w13 / w2 instead, as S = shared
width / expert width experts of their own (the MLP's intermediate columns cut into S chunks: the
same sum), and every token's pairs gain them, with weight 1 and ids E..E+S-1, after routing and
counting: one MoE launch for the block.

Expert parallelism (`experts=(first, count)`): the block holds experts [first, first + count)
of the E the router chooses among; the router runs whole (every rank selects the same pairs),
a pair whose expert is elsewhere gets id -1, which every MoE backend skips (it adds zero), and
the layer's all-reduce (models/decoder.py) sums the ranks' partials. Expert load counts the
global ids, so every rank counts every pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moeserve import envs
from moeserve.kernels.moe.quant import moe_quantized
from moeserve.kernels.registry import bind_routed_experts, moe_tile_source
from moeserve.kernels.routing.grouped_triton import (
    grouped_supported,
    select_experts_grouped_triton,
)
from moeserve.kernels.routing.select import (
    router_logits_fp32,
    select_experts,
    select_experts_grouped,
    select_experts_softmax_grouped,
)
from moeserve.kernels.routing.select_triton import MAX_EXPERTS, select_experts_triton
from moeserve.layers.linear import WeightFactory
from moeserve.layers.mlp import MLP
from moeserve.layers.params import empty_param
from moeserve.model_config import ConfigError, ModelConfig
from moeserve.quant.packed import QuantWeight

# The sigmoid router as one Triton launch on CUDA (module doc): a dozen small launches a MoE
# layer replaced by one, on since the H200's A/B (gpu_bb408cc/call2: glm-4.7-flash's W1 at
# 256, 9,593 / 9,533 against 9,200 / 9,179 output tok/s off); MOESERVE_GROUPED_ROUTER_TRITON=0
# turns it off (a server's processes too). `grouped_router_interpret`: tests, also on CPU
# under Triton's interpreter.
grouped_router_triton = envs.grouped_router_triton()
grouped_router_interpret = False
# fn(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]) -> [T, H]
MoeBackend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      torch.Tensor]



class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: MoeBackend,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 experts: tuple[int, int] | None = None,
                 weights: WeightFactory | None = None) -> None:
        """weights: declares the experts' and shared experts' weights under the model's
        quantization plan (the router stays in the engine's dtype)."""
        super().__init__()
        weights = weights or WeightFactory()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.first_expert, local = experts if experts is not None else (0, e)
        self.num_local_experts = local
        self.sharded = local != e
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.router = config.router
        # a rank with some of the experts looks its tiles up at its own pairs' density
        self.routed_experts = e if self.sharded else None
        self.backend = bind_routed_experts(moe_backend, e) if self.sharded else moe_backend
        self.tiles = moe_tile_source(moe_backend)  # the quantized experts' tile source
        self.gate = empty_param(e, h, dtype=dtype, device=device)  # router, [E, hidden]
        self.correction_bias = (empty_param(e, dtype=torch.float32, device=device)
                                if config.router.correction_bias else None)  # [E] fp32
        self.w13 = weights.linear("w13", local, 2 * i, h, dtype=dtype,
                                  device=device)  # [E, 2I, hidden]
        self.w2 = weights.linear("w2", local, h, i, dtype=dtype, device=device)  # [E, hidden, I]
        self.shared_experts = (MLP(h, config.shared_expert_intermediate_size, dtype, device,
                                   weights.child("shared_experts"))
                               if config.shared_expert_intermediate_size else None)
        self.folded_shared = 0  # shared experts appended to w13 / w2 (fold_shared_experts)
        self.expert_counts: torch.Tensor | None = None  # [E] int64, bound by the runner
        self.count_mask: torch.Tensor | None = None  # [T] int64, set around CUDA-graph decode

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reduce False -> [T, S, hidden] whose sum over S is
        that (the MoeFn contract in kernels/registry.py; shared experts are added into the first
        routed part)."""
        routed = self._routed(x, reduce)
        if self.shared_experts is None:
            return routed
        mlp = self.shared_experts
        if reduce:
            return routed + mlp(x)
        # added into the first routed part in place (the parts are this call's own tensor):
        # the same sum over the parts with no [T, S + 1, hidden] copy, which took 0.53 ms of
        # glm-4.7-flash's 1,024-row decode step on the H200 (gpu_bb408cc/call7_w1_glm47_2ae848a);
        # a plain down_proj adds it in its GEMM's epilogue (C = the part, beta 1: cuBLAS takes
        # the part's row stride as C's leading dimension), not by an add of its own (0.40 ms of
        # that step in 46 launches, gpu_7c427c9/call5)
        part = routed[:, 0]  # [T, hidden], a view
        if isinstance(mlp.down_proj, QuantWeight):
            part += mlp(x)
        else:
            part.addmm_(mlp.activation(x), mlp.down_proj.t())
        return routed  # [T, S, hidden]

    def fold_shared_experts(self) -> str:
        """Append the shared experts to the routed stack (module doc); returns why they stay
        a separate MLP, or "" once folded (or when the block has none)."""
        mlp = self.shared_experts
        if mlp is None:
            return ""
        if isinstance(self.w13, QuantWeight) or isinstance(mlp.gate_up_proj, QuantWeight):
            return "quantized weights"
        if self.sharded:
            return ("expert parallelism (the routed experts are split by rank, the shared "
                    "ones by TP)")
        width, shared = self.w2.shape[-1], mlp.intermediate_size
        if shared % width:
            return f"shared width {shared} is not a multiple of the experts' {width}"
        s, hidden = shared // width, self.w13.shape[-1]
        gate_up = mlp.gate_up_proj.detach()  # [2 SI, H]: gate rows, then up rows
        w13 = torch.cat([gate_up[:shared].view(s, width, hidden),
                         gate_up[shared:].view(s, width, hidden)], dim=1)  # [S, 2I, H]
        w2 = mlp.down_proj.detach().view(hidden, s, width).transpose(0, 1)  # [S, H, I]
        self.w13 = nn.Parameter(torch.cat([self.w13.detach(), w13]), requires_grad=False)
        self.w2 = nn.Parameter(torch.cat([self.w2.detach(), w2]), requires_grad=False)
        self.shared_experts, self.folded_shared = None, s
        return ""

    def _routed(self, x: torch.Tensor, reduce: bool) -> torch.Tensor:
        r = self.router
        if r.logits_fp32:
            router_logits = router_logits_fp32(x, self.gate)  # [T, E] fp32, as HF
        else:
            router_logits = F.linear(x, self.gate)  # [T, E]
        if r.scoring == "softmax" and r.topk_method == "greedy" and r.routed_scaling_factor == 1:
            if x.is_cuda and router_logits.shape[1] <= MAX_EXPERTS:
                topk_weights, topk_ids = select_experts_triton(
                    router_logits, self.top_k, self.renormalize, counts=self.expert_counts,
                    count_mask=self._count_mask(x))
                return self._experts(x, topk_weights, topk_ids, reduce)
            topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        elif r.scoring == "softmax":
            topk_weights, topk_ids = select_experts_softmax_grouped(
                router_logits, self.top_k, num_groups=r.n_group, topk_groups=r.topk_group,
                scaling_factor=r.routed_scaling_factor)
        elif (grouped_router_triton and (x.is_cuda or grouped_router_interpret)
              and grouped_supported(router_logits.shape[1], r.n_group, r.topk_group)):
            topk_weights, topk_ids = select_experts_grouped_triton(
                router_logits, self.top_k, num_groups=r.n_group, topk_groups=r.topk_group,
                correction_bias=self.correction_bias, renormalize=self.renormalize,
                scaling_factor=r.routed_scaling_factor, counts=self.expert_counts,
                count_mask=self._count_mask(x))
            return self._experts(x, topk_weights, topk_ids, reduce)
        else:
            topk_weights, topk_ids = select_experts_grouped(
                router_logits, self.top_k, num_groups=r.n_group, topk_groups=r.topk_group,
                correction_bias=self.correction_bias, renormalize=self.renormalize,
                scaling_factor=r.routed_scaling_factor)
        if self.expert_counts is not None:
            # NOTE: scatter_add_, not bincount: bincount syncs with the host
            ids = topk_ids.flatten()  # [T * k]
            if self.count_mask is None:
                ones = torch.ones_like(ids)
            else:
                ones = self.count_mask[:, None].expand(-1, self.top_k).reshape(-1)  # [T * k]
            self.expert_counts.scatter_add_(0, ids, ones)
        return self._experts(x, topk_weights, topk_ids, reduce)

    def _count_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """The count mask a fused router takes: None unless expert load is counted."""
        mask = self.count_mask
        if mask is not None and mask.shape[0] != x.shape[0]:
            raise ValueError(f"count_mask has {mask.shape[0]} rows for {x.shape[0]} tokens")
        return mask if self.expert_counts is not None else None

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 reduce: bool) -> torch.Tensor:
        """The backend over this block's experts: global ids -> local, -1 for the others."""
        if self.sharded:
            local = topk_ids - self.first_expert
            held = (local >= 0) & (local < self.num_local_experts)
            topk_ids = torch.where(held, local, torch.full_like(local, -1))
        if self.folded_shared:  # every token's pairs gain the shared experts, weight 1
            shared = torch.arange(self.num_local_experts, self.num_local_experts
                                  + self.folded_shared, dtype=topk_ids.dtype, device=x.device)
            topk_ids = torch.cat([topk_ids, shared.expand(x.shape[0], -1)], dim=1)
            topk_weights = torch.cat([topk_weights, torch.ones(
                x.shape[0], self.folded_shared, dtype=topk_weights.dtype, device=x.device)], 1)
        if isinstance(self.w13, QuantWeight):
            return moe_quantized(x, self.w13, self.w2, topk_weights, topk_ids, reduce=reduce,
                                 tiles=self.tiles, routed_experts=self.routed_experts)
        return self.backend(x, self.w13, self.w2, topk_weights, topk_ids, reduce=reduce)


def fold_shared_experts(blocks: list[SparseMoeBlock]) -> str:
    """The engine's fold_shared_experts over a model's MoE blocks (each block's
    `fold_shared_experts`): the capacity report's line, or "" when no block has shared
    experts."""
    blocks = [b for b in blocks if b.shared_experts is not None]
    if not blocks:
        return ""
    reasons = {b.fold_shared_experts() for b in blocks}
    if reasons == {""}:
        b = blocks[0]
        return (f"folded into the routed experts' launch: {b.folded_shared} more expert(s) "
                f"a block, always selected (w13 {list(b.w13.shape)})")
    return "a separate MLP (fold_shared_experts: " + "; ".join(sorted(reasons - {""})) + ")"


def tile_experts(blocks: list[SparseMoeBlock], layout: str, device: torch.device) -> str:
    """The engine's moe_weight_layout over a model's MoE blocks: NVFP4 / INT4 routed experts
    micro-tiled in place (kernels/moe/quant/micro_tiles.py) with "micro", or with "auto" on
    CUDA where they fit; the capacity report's line ("" for a model without 4-bit experts and
    "auto"). Raises ConfigError where "micro" cannot be kept."""
    from moeserve.kernels.moe.quant.micro_tiles import micro_unfit, tile_in_place

    weights = [w for b in blocks for w in (b.w13, b.w2) if isinstance(w, QuantWeight)]
    fmt = weights[0].format if weights else None
    if fmt not in ("nvfp4", "int4"):
        if layout == "micro":
            raise ConfigError(f"moe_weight_layout micro needs NVFP4 or INT4 routed experts; "
                              f"this model's are {fmt or 'unquantized'}")
        return ""
    if layout == "rows":
        return f"{fmt} experts in rows (moe_weight_layout rows)"
    why = ("the fused MoE reads micro-tiles on CUDA only (the reference reads rows)"
           if device.type != "cuda" else
           next(filter(None, map(micro_unfit, weights)), ""))
    if why:
        if layout == "micro":
            raise ConfigError(f"moe_weight_layout micro: {why}")
        return f"{fmt} experts in rows: {why}"
    for w in weights:
        tile_in_place(w)
    return f"{fmt} experts micro-tiled (16 rows x 64 bytes; moe_weight_layout {layout})"
