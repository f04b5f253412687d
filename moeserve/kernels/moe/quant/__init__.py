"""The routed experts over quantized weights (moeserve/quant/packed.py's layouts): the
sub-package of the quantized MoE kernels, and here `moe_quantized`, which picks the op.

    fused_triton.py  the fused MoE over packed weights (Triton), its two launches
    dequant.py       large steps of the 4-bit formats: the experts dequantized once, then the
                     bf16 fused MoE
    ref.py           its torch reference, expert by expert
    configs.py       its tile configs: defaults, per-format rules, the tuned files' lookup
    tune.py          the tuner of those files (CUDA graphs, resumable, time-bounded)

    CUDA       fused_triton.moe_quant_triton: the fused MoE's two launches with the
               weight tiles dequantized in their loads (nvfp4 / int4, W4A16) or read as e4m3
               against activations quantized per token and 128-group (fp8, W8A8); nvfp4 /
               int4 steps of many tokens: dequant.moe_dequant (`choose_moe_dequant`)
    elsewhere  ref.moe_quant_ref: the same arithmetic in torch, expert by expert

The CUDA op's tiles: tuned per format and shape (tune.py, looked up by configs.py),
or with tiles "default" its in-code defaults. Same contract as the bf16 backends
(kernels/registry.py's MoeFn): ids of -1 add nothing, reduce=False returns [T, S, hidden] parts.
"""

from __future__ import annotations

import torch

from moeserve.quant.packed import QuantWeight


def moe_quantized(x: torch.Tensor, w13: QuantWeight, w2: QuantWeight,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  reduce: bool = True, tiles: str = "tuned",
                  routed_experts: int | None = None) -> torch.Tensor:
    """tiles: the CUDA kernel's tile source (tile_configs.TILE_SOURCES, the engine's
    moe_tiles); routed_experts: the model's, when this rank holds some of them (the tiles'
    lookup, tile_configs.tile_tokens); the reference has no tiles."""
    if w13.format != w2.format:
        raise ValueError(f"w13 is {w13.format} but w2 is {w2.format}")
    if x.is_cuda:
        from moeserve.kernels.moe.quant.dequant import choose_moe_dequant, moe_dequant
        from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton

        if choose_moe_dequant(w13, w2, x.shape[0], x):
            return moe_dequant(x, w13, w2, topk_weights, topk_ids, reduce=reduce, tiles=tiles,
                               routed_experts=routed_experts)

        return moe_quant_triton(x, w13, w2, topk_weights, topk_ids, tiles=tiles, reduce=reduce,
                                routed_experts=routed_experts)
    from moeserve.kernels.moe.quant.ref import moe_quant_ref

    return moe_quant_ref(x, w13, w2, topk_weights, topk_ids, reduce=reduce)
