"""HF tensor names -> our (packed) parameters, for every family served.

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.                                  -> layer i's
      input_layernorm / post_attention_layernorm.weight
      GQA  self_attn.{q,k,v}_proj.weight (.bias: GLM-4.5) -> self_attn.qkv_proj rows [q | k | v]
           self_attn.{o_proj, q_norm, k_norm}.weight
      MLA  self_attn.q_a_proj.weight (or q_proj)         -> self_attn.in_proj rows [0, q part)
           self_attn.kv_a_proj_with_mqa.weight           -> self_attn.in_proj rows [q part,
                                                              latent_end)
           self_attn.{q_a_layernorm, kv_a_layernorm, q_b_proj, kv_b_proj, o_proj}.weight
      DSA  (MLA's, and on a "full" layer) self_attn.indexer.wk.weight -> self_attn.in_proj rows
           [latent_end, end); self_attn.indexer.{wq_b, weights_proj (fp32 here), k_norm
           (weight and bias)}
      dense  mlp.{gate,up}_proj.weight, mlp.down_proj.weight -> mlp.gate_up_proj [gate | up],
                                                                 mlp.down_proj
      MoE  mlp.experts.{e}.{gate,up,down}_proj.weight  -> mlp.w13[e, :I], w13[e, I:], w2[e]
           (Mixtral: block_sparse_moe.experts.{e}.{w1,w3,w2}; the fused layout
           mlp.experts.{gate_up_proj,down_proj} written by save_original_format=False)
           mlp.gate.weight (router), mlp.gate.e_score_correction_bias (sigmoid routers)
           mlp.shared_experts.{gate,up,down}_proj.weight -> mlp.shared_experts (a dense MLP)
    model.layers.{checkpoint_layers + j}.*  (j < mtp_layers): multi-token-prediction layers; not
           loaded (kept aside for speculative decoding), counted in the capacity report; so are
           the layers num_layers .. checkpoint_layers that an hf_overrides slice cuts off
"""

from __future__ import annotations

import re

import torch

from moeserve.layers.attention import Attention
from moeserve.layers.dsa import DsaAttention
from moeserve.layers.mla import MLAttention
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import SparseMoeBlock
from moeserve.model_config import ModelConfig
from moeserve.models.decoder import CausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def left_out_layer_names(cfg: ModelConfig, names: set[str],
                         checkpoint_layers: int | None = None) -> set[str]:
    """The tensors of the checkpoint's layers the served model does not run: its
    multi-token-prediction layers (checkpoint_layers .. + mtp_layers) and, when hf_overrides
    cut num_hidden_layers, the decoder layers num_layers .. checkpoint_layers.

    Args:
        checkpoint_layers: the checkpoint's own num_hidden_layers (None: cfg.num_layers).
    """
    total = checkpoint_layers if checkpoint_layers is not None else cfg.num_layers
    left_out = range(cfg.num_layers, total + cfg.mtp_layers)
    return {n for n in names if (m := _LAYER.match(n)) and int(m.group(1)) in left_out}


def weight_targets(model: CausalLM, cfg: ModelConfig,
                   names: set[str]) -> dict[str, torch.Tensor]:
    """HF tensor name -> the parameter (or the slice of a packed one) it is copied into."""
    m = model.model
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": m.embed_tokens,
                                  "model.norm.weight": m.norm.weight}
    if model.lm_head is not None:
        t["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        if isinstance(layer.self_attn, MLAttention):
            t.update(_mla_targets(p + "self_attn.", layer.self_attn))
        else:
            t.update(_gqa_targets(p + "self_attn.", layer.self_attn, cfg))
        t[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        if isinstance(layer.mlp, MLP):
            t.update(_mlp_targets(p + "mlp.", layer.mlp))
        else:
            t.update(_expert_targets(p, layer.mlp, cfg, names))
    return t


def _gqa_targets(p: str, attn: Attention, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    t = {p + "q_proj.weight": attn.qkv_proj[:q], p + "k_proj.weight": attn.qkv_proj[q:q + kv],
         p + "v_proj.weight": attn.qkv_proj[q + kv:], p + "o_proj.weight": attn.o_proj}
    if attn.qkv_bias is not None:
        t.update({p + "q_proj.bias": attn.qkv_bias[:q], p + "k_proj.bias": attn.qkv_bias[q:q + kv],
                  p + "v_proj.bias": attn.qkv_bias[q + kv:]})
    if attn.q_norm is not None:
        t[p + "q_norm.weight"] = attn.q_norm.weight
        t[p + "k_norm.weight"] = attn.k_norm.weight
    return t


def _mla_targets(p: str, attn: MLAttention) -> dict[str, torch.Tensor]:
    q_name = "q_a_proj" if attn.q_b_proj is not None else "q_proj"
    t = {p + f"{q_name}.weight": attn.in_proj[:attn.q_part],
         p + "kv_a_proj_with_mqa.weight": attn.in_proj[attn.q_part:attn.latent_end],
         p + "kv_a_layernorm.weight": attn.kv_a_layernorm.weight,
         p + "kv_b_proj.weight": attn.kv_b_proj, p + "o_proj.weight": attn.o_proj}
    if attn.q_b_proj is not None:
        t[p + "q_a_layernorm.weight"] = attn.q_a_layernorm.weight
        t[p + "q_b_proj.weight"] = attn.q_b_proj
    indexer = attn.indexer if isinstance(attn, DsaAttention) else None
    if indexer is not None:
        t.update({p + "indexer.wk.weight": attn.in_proj[attn.latent_end:],
                  p + "indexer.wq_b.weight": indexer.wq_b,
                  p + "indexer.weights_proj.weight": indexer.weights_proj,
                  p + "indexer.k_norm.weight": indexer.k_norm.weight,
                  p + "indexer.k_norm.bias": indexer.k_norm.bias})
    return t


def _mlp_targets(p: str, mlp: MLP) -> dict[str, torch.Tensor]:
    inter = mlp.intermediate_size
    return {p + "gate_proj.weight": mlp.gate_up_proj[:inter],
            p + "up_proj.weight": mlp.gate_up_proj[inter:], p + "down_proj.weight": mlp.down_proj}


def _expert_targets(prefix: str, moe: SparseMoeBlock, cfg: ModelConfig,
                    names: set[str]) -> dict[str, torch.Tensor]:
    fused = prefix + "mlp.experts.gate_up_proj" in names  # transformers' in-memory layout
    mixtral = cfg.architecture == "MixtralForCausalLM" and not fused
    p = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    t: dict[str, torch.Tensor] = {p + "gate.weight": moe.gate}
    if moe.correction_bias is not None:
        t[p + "gate.e_score_correction_bias"] = moe.correction_bias
    if moe.shared_experts is not None:
        t.update(_mlp_targets(p + "shared_experts.", moe.shared_experts))
    if fused:
        t[p + "experts.gate_up_proj"] = moe.w13  # [E, 2I, hidden]
        t[p + "experts.down_proj"] = moe.w2  # [E, hidden, I]
        return t
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    inter = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        t[f"{p}experts.{e}.{gate}.weight"] = moe.w13[e, :inter]
        t[f"{p}experts.{e}.{up}.weight"] = moe.w13[e, inter:]
        t[f"{p}experts.{e}.{down}.weight"] = moe.w2[e]
    return t
