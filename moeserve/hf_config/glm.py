"""GLM-4.5 / 4.6 / 4.7 and -Air (Glm4Moe, GQA), GLM-4.7-Flash (Glm4MoeLite, MLA) and GLM-5
(GlmMoeDsa, MLA + DeepSeek Sparse Attention) config.json -> ModelConfig.

The published GLM configs carry no family-specific inert field (fields.INERT covers theirs:
`pad_token_id`, `initializer_range`, `use_cache`, ...). Checked: `topk_method` noaux_tc,
`scoring_func` sigmoid (GLM-4.7-Flash's config names only the former), Glm4MoeLite's
`attention_bias` false and `rope_interleave` a bool, the MLA `head_dim` / `qk_head_dim`.
Honoured: the shapes, `attention_bias` (GLM-4.5's q/k/v biases), `use_qk_norm`,
`partial_rotary_factor` (0.5 when absent, transformers' default for Glm4Moe), RoPE,
`first_k_dense_replace` (Glm4Moe) or `mlp_layer_types` (Glm4MoeLite), the router's `n_group` /
`topk_group` / `routed_scaling_factor` / `norm_topk_prob`, `n_shared_experts`, and
`num_nextn_predict_layers` (transformers' `num_mtp_layers`): the MTP layers' count, their weights
not served. `n_routed_experts` may be spelled `num_local_experts` (transformers' alias).

GLM-5 (`GlmMoeDsaForCausalLM`): Glm4MoeLite's MLA fields and the router's, plus the DSA
fields (hf_config/dsa.py: the indexer, `indexer_types` or its schedule, `mlp_layer_types` or
`first_k_dense_replace`, the RoPE layouts). Its published config also carries `ep_size` (inert:
the expert-parallel size of a launch) and `moe_layer_freq` (checked: 1, every layer past the
dense ones sparse).
"""

from __future__ import annotations

from typing import Any

from moeserve.config import ConfigError
from moeserve.hf_config import dsa, fields
from moeserve.hf_config.deepseek import INERT as DEEPSEEK_INERT
from moeserve.hf_config.deepseek import mla_config
from moeserve.model_config import ModelConfig, RouterConfig

_MOE = {"n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
        "n_shared_experts", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
        "topk_method", "scoring_func", "num_nextn_predict_layers", "num_mtp_layers"}
KNOWN = {
    "Glm4MoeForCausalLM": _MOE | {"attention_bias", "partial_rotary_factor", "use_qk_norm",
                                  "first_k_dense_replace"},
    "Glm4MoeLiteForCausalLM": _MOE | {"attention_bias", "partial_rotary_factor", "q_lora_rank",
                                      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                      "v_head_dim", "qk_head_dim", "rope_interleave",
                                      "mlp_layer_types", "first_k_dense_replace"},
    "GlmMoeDsaForCausalLM": _MOE | dsa.FIELDS | dsa.GLM_INDEXER | {
        "attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "qk_head_dim", "first_k_dense_replace", "moe_layer_freq", "ep_size"},
}
INERT = {"ep_size": DEEPSEEK_INERT["ep_size"]} | dsa.INERT


def parse(hf: dict[str, Any], arch: str) -> ModelConfig:
    fields.check_known(hf, arch, KNOWN[arch])
    fields.check_value(hf, "topk_method", ("noaux_tc",))
    fields.check_value(hf, "scoring_func", ("sigmoid",))
    common = fields.common(hf, arch)
    router = RouterConfig(scoring="sigmoid", topk_method="noaux_tc",
                          n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                          routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                          logits_fp32=True)
    moe = dict(router=router,
               num_experts=hf.get("n_routed_experts") or hf.get("num_local_experts") or 0,
               num_experts_per_tok=hf["num_experts_per_tok"],
               moe_intermediate_size=hf["moe_intermediate_size"],
               norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
               shared_expert_intermediate_size=(hf["moe_intermediate_size"]
                                                * (hf.get("n_shared_experts") or 0)),
               mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
                              or 0))
    if arch == "Glm4MoeForCausalLM":
        # transformers' Glm4MoeConfig: partial_rotary_factor 0.5 when absent
        hf = {"partial_rotary_factor": 0.5, **hf}
        common["rope"] = fields.rope(hf, common["head_dim"])
        first_dense = hf.get("first_k_dense_replace", 1)
        return ModelConfig(**common, **moe, qkv_bias=bool(hf.get("attention_bias", False)),
                           qk_norm=bool(hf.get("use_qk_norm", False)),
                           mlp_only_layers=tuple(range(min(first_dense, common["num_layers"]))))
    fields.check_value(hf, "attention_bias", (False,))
    mla = mla_config(hf)
    common.update(num_kv_heads=common["num_heads"], head_dim=mla.qk_head_dim)
    if arch == "GlmMoeDsaForCausalLM":  # both RoPEs interleaved (checked in dsa_config)
        fields.check_value(hf, "moe_layer_freq", (1,))
        common["rope"] = fields.rope(hf, mla.qk_rope_head_dim, interleaved=True)
        return ModelConfig(**common, **moe, mla=mla, dsa=dsa.dsa_config(hf, glm=True),
                           mlp_only_layers=dsa.dense_layers(hf))
    fields.check_value(hf, "rope_interleave", (True, False))
    common["rope"] = fields.rope(hf, mla.qk_rope_head_dim,
                                 interleaved=bool(hf.get("rope_interleave", True)))
    return ModelConfig(**common, **moe, mla=mla, mlp_only_layers=_lite_dense_layers(hf))


def _lite_dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """Glm4MoeLite's dense layers: `mlp_layer_types` ("dense" / "sparse" per layer), default
    the first layer dense (transformers ignores `first_k_dense_replace`; one that disagrees
    with the layer types is refused rather than guessed)."""
    n = hf["num_hidden_layers"]
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {n} "
                          f"layers, got {types}")
    dense = tuple(i for i, t in enumerate(types) if t == "dense")
    k = hf.get("first_k_dense_replace")
    if k is not None and dense != tuple(range(k)):
        raise ConfigError(f"first_k_dense_replace {k} disagrees with mlp_layer_types "
                          f"(dense layers {list(dense)}); transformers follows mlp_layer_types")
    return dense
