"""DeepSeek-V2 / V2-Lite, DeepSeek-V3 / R1, Moonlight, Kimi K2 and DeepSeek-V3.2 config.json ->
ModelConfig.

Kimi K2's published config says `model_type: kimi_k2` with `DeepseekV3ForCausalLM`: the same
model, parsed here. Published configs carry fields transformers never writes (`scoring_func`,
`topk_method`, `moe_layer_freq`, `ep_size`, `aux_loss_alpha`, `seq_aux`, ...): each is honoured,
checked against the one value we implement, or inert (`INERT` below, with the reason).

Checked (refused at any other value): `attention_bias` and `mlp_bias` false; `moe_layer_freq` 1
(every layer past the dense ones is sparse); `scoring_func` sigmoid (V3) / softmax (V2);
`topk_method` noaux_tc (V3) / greedy or group_limited_greedy (V2); V2's `norm_topk_prob` false
(transformers' DeepseekV2 router never renormalises, DeepSeek's own code does when true: a true
would be ambiguous); `rope_interleave` a bool; `head_dim` and `qk_head_dim` consistent with the MLA
dims. Honoured: the shapes, `n_shared_experts`, `first_k_dense_replace`, the router's
`n_group` / `topk_group` / `routed_scaling_factor` / `norm_topk_prob` (V3), RoPE (YaRN included),
`num_nextn_predict_layers` (the MTP layers' count: their weights are not served).

DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) is V3 with DeepSeek Sparse Attention: its indexer
fields, `mlp_layer_types` and the RoPE layouts are read by hf_config/dsa.py (every layer
"full"; transformers' V3.2 has no shared layers). Its MLA needs q_lora_rank (the indexer's
queries come from the q_lora output).
"""

from __future__ import annotations

from typing import Any

from moeserve.config import ConfigError
from moeserve.hf_config import dsa, fields
from moeserve.model_config import MlaConfig, ModelConfig, RouterConfig

# Published-config fields with no effect on inference: field -> why.
INERT: dict[str, str] = {
    "aux_loss_alpha": "training: the weight of the auxiliary expert-balance loss",
    "seq_aux": "training: computes that balance loss per sequence",
    "ep_size": "the expert-parallel size DeepSeek's remote code was launched with",
}
_MLA = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "qk_head_dim", "attention_bias"}
_MOE = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
        "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob", "routed_scaling_factor",
        "n_group", "topk_group", "topk_method", "scoring_func", "num_local_experts"}
KNOWN = {
    "DeepseekV2ForCausalLM": set(INERT) | _MLA | _MOE | {"mlp_bias"},
    "DeepseekV3ForCausalLM": set(INERT) | _MLA | _MOE | {"rope_interleave",
                                                         "num_nextn_predict_layers"},
    "DeepseekV32ForCausalLM": set(INERT) | _MLA | _MOE | dsa.FIELDS | {"num_nextn_predict_layers"},
}


def parse(hf: dict[str, Any], arch: str) -> ModelConfig:
    fields.check_known(hf, arch, KNOWN[arch])
    v32 = arch == "DeepseekV32ForCausalLM"
    v3 = arch == "DeepseekV3ForCausalLM" or v32
    fields.check_value(hf, "attention_bias", (False,))
    fields.check_value(hf, "mlp_bias", (False,))
    fields.check_value(hf, "moe_layer_freq", (1,))
    fields.check_value(hf, "scoring_func", ("sigmoid",) if v3 else ("softmax",))
    fields.check_value(hf, "topk_method",
                       ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy"))
    if not v3:
        fields.check_value(hf, "norm_topk_prob", (False,))
    mla = mla_config(hf)
    common = fields.common(hf, arch)
    # MLA: every head has its own K/V (up-projected from the shared latent); the rope part of
    # a head is qk_rope_head_dim wide (transformers' head_dim for these configs).
    common.update(num_kv_heads=common["num_heads"], head_dim=mla.qk_head_dim)
    # V2's RoPE is always interleaved (complex pairs), V3's when rope_interleave (its default).
    fields.check_value(hf, "rope_interleave", (True, False))
    interleaved = bool(hf.get("rope_interleave", True)) if v3 else True
    sparse = dsa.dsa_config(hf, glm=False) if v32 else None  # V3.2: always interleaved
    common["rope"] = fields.rope(hf, mla.qk_rope_head_dim, interleaved=interleaved)
    num_experts = hf.get("n_routed_experts") or hf.get("num_local_experts") or 0
    if v3:
        router = RouterConfig(scoring="sigmoid", topk_method="noaux_tc",
                              n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                              logits_fp32=True)
        norm = bool(hf.get("norm_topk_prob", True))
    else:
        router = RouterConfig(scoring="softmax", topk_method=hf.get("topk_method", "greedy"),
                              n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                              logits_fp32=True)
        norm = False  # transformers' DeepseekV2TopkRouter never renormalises
    first_dense = hf.get("first_k_dense_replace", 3 if v3 else 0)
    dense = (dsa.dense_layers(hf) if v32
             else tuple(range(min(first_dense, common["num_layers"]))))
    return ModelConfig(
        **common, mla=mla, dsa=sparse, router=router, num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        moe_intermediate_size=hf.get("moe_intermediate_size", 0), norm_topk_prob=norm,
        shared_expert_intermediate_size=(hf.get("moe_intermediate_size", 0)
                                         * (hf.get("n_shared_experts") or 0)),
        mlp_only_layers=dense,
        mtp_layers=int(hf.get("num_nextn_predict_layers") or 0) if v3 else 0)


def mla_config(hf: dict[str, Any]) -> MlaConfig:
    """The MLA dims (shared by DeepSeek and GLM-4.7-Flash); q_lora_rank None: no q compression.
    transformers 5 writes the derived `qk_head_dim` and `head_dim` (= qk_rope_head_dim, the
    rotary width) into the configs it saves: accepted when they agree."""
    mla = MlaConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"],
                    qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"])
    if hf.get("qk_head_dim") not in (None, mla.qk_head_dim):
        raise ConfigError(f"qk_head_dim {hf['qk_head_dim']} must equal qk_nope_head_dim + "
                          f"qk_rope_head_dim = {mla.qk_head_dim}")
    if hf.get("head_dim") not in (None, mla.qk_rope_head_dim):
        raise ConfigError(f"head_dim {hf['head_dim']} must equal qk_rope_head_dim "
                          f"{mla.qk_rope_head_dim} for an MLA model")
    return mla
