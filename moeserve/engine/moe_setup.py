"""The engine's MoE start-up outside the core: the quantized experts' tune, and the tiles the
capacity report shows (bf16 and quantized), and the token counts the warm-up compiles.
`EngineCore._ensure_moe_tuned` calls the tune; `_report_moe_configs` the reports."""

from __future__ import annotations

import torch

from moeserve.config import EngineConfig
from moeserve.kernels.moe.tile_configs import tile_device_name
from moeserve.kernels.registry import TILED_MOE_BACKENDS
from moeserve.model_config import ModelConfig


def ensure_quant_moe_tuned(cfg: EngineConfig, mc: ModelConfig, block: torch.nn.Module,
                            dtype: torch.dtype, device: torch.device) -> str:
    """`_ensure_moe_tuned` for quantized experts (the fused quantized MoE's tiles, per format:
    kernels/moe/quant/tune.py), on the block's own weights; the capacity report's line."""
    w13 = block.w13
    fmt, group = w13.format, max(w13.group, block.w2.group)
    if cfg.moe_tiles == "default":
        return (f"not tuned: moe_tiles=default ({fmt} experts: the fused quantized MoE's "
                "in-code default tiles at every batch size, no tuned file read)")
    if device.type != "cuda":
        return ""  # the torch reference runs the quantized experts: no tiles
    from moeserve.kernels.moe.quant.configs import find_quant_tuned
    from moeserve.kernels.moe.quant.micro_tiles import is_micro
    from moeserve.kernels.moe.quant.tune import ensure_quant_tuned

    shape = (fmt, block.num_local_experts, mc.hidden_size, block.w2.shape[-1],
             mc.num_experts_per_tok, group, dtype)
    if cfg.moe_tune_budget_s == 0:
        found = find_quant_tuned(*shape, tile_device_name(device),
                                 layout="micro" if is_micro(w13) else "rows")
        return (f"not tuned at start-up (moe_tune_budget_s=0; {fmt} experts): "
                + (f"using {found[0]}" if found else "default tiles"))
    outcome = ensure_quant_tuned(*shape, cfg.scheduler.max_num_batched_tokens,
                                 time_budget_s=cfg.moe_tune_budget_s,
                                 weights=(block.w13, block.w2),
                                 device_name=tile_device_name(device))
    torch.cuda.empty_cache()
    return f"{fmt} experts: {outcome.detail} ({outcome.source}, {outcome.seconds:.1f}s)"


def moe_configs(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype,
                 device_name: str, shape: tuple[int, int, int] | None,
                 routed_local: int | None = None, top_k: int | None = None) -> dict[str, dict]:
    """The fused-MoE tile config at a few batch sizes, and whether each was tuned (report),
    from the engine's tile source (moe_tiles: "default" gives tuned False, source "default",
    backend "triton" everywhere). "tiles" names the config (`config_key`: M.._N.._K.._G.._w..
    _s.., then +down_N.. when the down launch has its own tiles). shape: this rank's (experts,
    hidden, width) as its w13 holds them (folded shared experts included); routed_local: its
    routed experts (the density of its pairs under EP; default shape's); top_k: each token's
    pairs (default the model's)."""
    if cfg.moe_backend not in TILED_MOE_BACKENDS or shape is None:
        return {}
    from moeserve.kernels.moe.tile_configs import config_key, get_moe_config, tile_tokens

    routed_local = shape[0] if routed_local is None else routed_local
    top_k = mc.num_experts_per_tok if top_k is None else top_k
    sizes = sorted({1, 64, 256, 1024, cfg.scheduler.max_num_batched_tokens})
    choices = {n: get_moe_config(*shape, top_k, dtype,
                                 tile_tokens(n, routed_local, mc.num_experts), device_name,
                                 tiles=cfg.moe_tiles) for n in sizes}
    measured = cfg.moe_backend == "measured"
    return {str(n): {"config": c.config, "tiles": config_key(c.config), "tuned": c.tuned,
                     "source": c.source,
                     "backend": c.backend if measured else "triton",
                     "tuned_tokens": c.tuned_tokens}
            for n, c in choices.items()}


def quant_moe_configs(cfg: EngineConfig, mc: ModelConfig, block: torch.nn.Module,
                       dtype: torch.dtype, device_name: str) -> dict[str, dict]:
    """`moe_configs` for quantized experts: the fused quantized MoE's tiles at a few batch
    sizes (quant.configs.get_quant_config with the engine's moe_tiles); backend "triton"
    everywhere (the quantized experts have no other), "format" the weights'."""
    from moeserve.kernels.moe.quant.configs import get_quant_config
    from moeserve.kernels.moe.quant.micro_tiles import is_micro
    from moeserve.kernels.moe.tile_configs import config_key, tile_tokens

    fmt, group = block.w13.format, max(block.w13.group, block.w2.group)
    sizes = sorted({1, 64, 256, 1024, cfg.scheduler.max_num_batched_tokens})
    local = block.num_local_experts
    choices = {n: get_quant_config(fmt, local, mc.hidden_size, block.w2.shape[-1],
                                   mc.num_experts_per_tok, group, dtype,
                                   tile_tokens(n, local, mc.num_experts), device_name,
                                   tiles=cfg.moe_tiles, micro=is_micro(block.w13)) for n in sizes}
    return {str(n): {"config": c.config, "tiles": config_key(c.config), "tuned": c.tuned,
                     "source": c.source, "backend": "triton", "tuned_tokens": c.tuned_tokens,
                     "format": fmt}
            for n, c in choices.items()}


def moe_token_counts(cfg: EngineConfig, mc: ModelConfig) -> list[int]:
    """The token counts whose MoE kernels the warm-up compiles: those the tune covers."""
    if not mc.num_experts:
        return []
    from moeserve.kernels.moe.tile_configs import engine_token_counts

    return engine_token_counts(cfg.scheduler.max_num_batched_tokens)
