"""Qwen3 (dense), Qwen3-MoE and Mixtral config.json -> ModelConfig."""

from __future__ import annotations

from typing import Any

from moeserve.config import ConfigError
from moeserve.hf_config import fields
from moeserve.model_config import ModelConfig

_GQA = {"attention_bias", "max_window_layers", "use_sliding_window", "sliding_window",
        "layer_types"}
_MOE = {"num_experts", "num_local_experts", "num_experts_per_tok"}
KNOWN = {
    "Qwen3ForCausalLM": _GQA,
    "Qwen3MoeForCausalLM": _GQA | _MOE | {"moe_intermediate_size", "decoder_sparse_step",
                                          "mlp_only_layers", "norm_topk_prob"},
    "MixtralForCausalLM": _GQA | _MOE,
}


def parse(hf: dict[str, Any], arch: str) -> ModelConfig:
    fields.check_known(hf, arch, KNOWN[arch])
    fields.no_sliding_window(hf)
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true is not implemented")
    common = fields.common(hf, arch)
    common["rope"] = fields.rope(hf, common["head_dim"])
    num_experts = hf.get("num_experts", hf.get("num_local_experts", 0)) or 0
    if arch == "Qwen3ForCausalLM":
        return ModelConfig(**common, qk_norm=True)
    if arch == "Qwen3MoeForCausalLM":
        return ModelConfig(**common, qk_norm=True, num_experts=num_experts,
                           num_experts_per_tok=hf["num_experts_per_tok"],
                           moe_intermediate_size=hf["moe_intermediate_size"],
                           norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                           decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                           mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
    return ModelConfig(**common, num_experts=num_experts,  # Mixtral: every layer sparse
                       num_experts_per_tok=hf["num_experts_per_tok"],
                       moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
