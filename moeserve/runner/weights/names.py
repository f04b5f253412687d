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

Under tensor / expert parallelism (parallel/layout.py) a rank copies its slice of each tensor:
a `Target` names the checkpoint's whole shape (checked as before) and the parts to copy, each a
destination and the index of the source it takes: query heads and their KV heads, MLA's q / kv_b
heads, the gate and up rows and the down columns of MLPs and of this rank's experts, o_proj's
columns and the vocabulary rows. Replicated tensors (norms, routers, MLA's q_a / kv_a, DSA's
indexer) are copied whole; another rank's experts have no parts (checked, not read).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from moeserve.layers.attention import Attention
from moeserve.layers.dsa import DsaAttention
from moeserve.layers.mla import MLAttention
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import SparseMoeBlock
from moeserve.model_config import ModelConfig
from moeserve.models.decoder import CausalLM
from moeserve.parallel.layout import RankLayout, kv_head_start, local_experts

Index = tuple[slice, ...]


class Target(NamedTuple):
    """Where one checkpoint tensor goes: its whole shape, and (destination, source index)
    parts; () copies the whole tensor, no parts copies nothing."""

    shape: tuple[int, ...]
    parts: tuple[tuple[torch.Tensor, Index], ...]


def whole(dest: torch.Tensor) -> Target:
    return Target(tuple(dest.shape), ((dest, ()),))


def rows(dest: torch.Tensor, start: int, total: int, dim: int = 0) -> Target:
    """dest holds source[start : start + n] along dim (n = dest's size there) of a tensor whose
    size along dim is total."""
    shape = list(dest.shape)
    shape[dim] = total
    index = (slice(None),) * dim + (slice(start, start + dest.shape[dim]),)
    return Target(tuple(shape), ((dest, index),))

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


def weight_targets(model: CausalLM, cfg: ModelConfig, names: set[str],
                   layout: RankLayout | None = None) -> dict[str, Target]:
    """HF tensor name -> where it goes (the parameter, or the slice of a packed one, and under
    parallelism the rank's part of the source: see the module doc)."""
    layout = layout or RankLayout()
    m = model.model
    vocab = min(m.embed_tokens.shape[0], cfg.vocab_size - m.vocab_start)  # the padding: no rows
    t: dict[str, Target] = {
        "model.embed_tokens.weight": rows(m.embed_tokens[:vocab], m.vocab_start, cfg.vocab_size),
        "model.norm.weight": whole(m.norm.weight)}
    if model.lm_head is not None:
        t["lm_head.weight"] = rows(model.lm_head[:vocab], m.vocab_start, cfg.vocab_size)
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        if isinstance(layer.self_attn, MLAttention):
            t.update(_mla_targets(p + "self_attn.", layer.self_attn, cfg, layout.rank))
        else:
            t.update(_gqa_targets(p + "self_attn.", layer.self_attn, cfg, layout))
        t[p + "input_layernorm.weight"] = whole(layer.input_layernorm.weight)
        t[p + "post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
        if isinstance(layer.mlp, MLP):
            t.update(_mlp_targets(p + "mlp.", layer.mlp, layout))
        else:
            t.update(_expert_targets(p, layer.mlp, cfg, names, layout))
    return t


def _gqa_targets(p: str, attn: Attention, cfg: ModelConfig,
                 layout: RankLayout) -> dict[str, Target]:
    d = cfg.head_dim
    q, kv = attn.num_heads * d, attn.num_kv_heads * d  # this rank's
    q0, kv0 = layout.rank * q, kv_head_start(cfg.num_kv_heads, layout) * d
    full_q, full_kv = cfg.num_heads * d, cfg.num_kv_heads * d
    t = {p + "q_proj.weight": rows(attn.qkv_proj[:q], q0, full_q),
         p + "k_proj.weight": rows(attn.qkv_proj[q:q + kv], kv0, full_kv),
         p + "v_proj.weight": rows(attn.qkv_proj[q + kv:], kv0, full_kv),
         p + "o_proj.weight": rows(attn.o_proj, q0, full_q, dim=1)}
    if attn.qkv_bias is not None:
        b = attn.qkv_bias
        t.update({p + "q_proj.bias": rows(b[:q], q0, full_q),
                  p + "k_proj.bias": rows(b[q:q + kv], kv0, full_kv),
                  p + "v_proj.bias": rows(b[q + kv:], kv0, full_kv)})
    if attn.q_norm is not None:
        t[p + "q_norm.weight"] = whole(attn.q_norm.weight)
        t[p + "k_norm.weight"] = whole(attn.k_norm.weight)
    return t


def _mla_targets(p: str, attn: MLAttention, cfg: ModelConfig, rank: int) -> dict[str, Target]:
    heads, m = attn.num_heads, cfg.mla  # this rank's heads, of cfg.num_heads
    h0, all_heads = rank * heads, cfg.num_heads

    def by_heads(dest: torch.Tensor, per_head: int, dim: int = 0) -> Target:
        return rows(dest, h0 * per_head, all_heads * per_head, dim)

    q = attn.in_proj[:attn.q_part]
    t = {p + "kv_a_proj_with_mqa.weight": whole(attn.in_proj[attn.q_part:attn.latent_end]),
         p + "kv_a_layernorm.weight": whole(attn.kv_a_layernorm.weight),
         p + "kv_b_proj.weight": by_heads(attn.kv_b_proj, m.qk_nope_head_dim + m.v_head_dim),
         p + "o_proj.weight": by_heads(attn.o_proj, m.v_head_dim, dim=1)}
    if attn.q_b_proj is not None:
        t[p + "q_a_proj.weight"] = whole(q)
        t[p + "q_a_layernorm.weight"] = whole(attn.q_a_layernorm.weight)
        t[p + "q_b_proj.weight"] = by_heads(attn.q_b_proj, m.qk_head_dim)
    else:
        t[p + "q_proj.weight"] = by_heads(q, m.qk_head_dim)
    indexer = attn.indexer if isinstance(attn, DsaAttention) else None
    if indexer is not None:  # replicated: every rank selects the same positions
        t.update({p + "indexer.wk.weight": whole(attn.in_proj[attn.latent_end:]),
                  p + "indexer.wq_b.weight": whole(indexer.wq_b),
                  p + "indexer.weights_proj.weight": whole(indexer.weights_proj),
                  p + "indexer.k_norm.weight": whole(indexer.k_norm.weight),
                  p + "indexer.k_norm.bias": whole(indexer.k_norm.bias)})
    return t


def _mlp_targets(p: str, mlp: MLP, layout: RankLayout) -> dict[str, Target]:
    """A dense MLP holding this rank's 1 / W of its width (column / row parallel)."""
    inter = mlp.intermediate_size  # this rank's
    start, total = layout.rank * inter, layout.world_size * inter
    return {p + "gate_proj.weight": rows(mlp.gate_up_proj[:inter], start, total),
            p + "up_proj.weight": rows(mlp.gate_up_proj[inter:], start, total),
            p + "down_proj.weight": rows(mlp.down_proj, start, total, dim=1)}


def _expert_targets(prefix: str, moe: SparseMoeBlock, cfg: ModelConfig, names: set[str],
                    layout: RankLayout) -> dict[str, Target]:
    fused = prefix + "mlp.experts.gate_up_proj" in names  # transformers' in-memory layout
    mixtral = cfg.architecture == "MixtralForCausalLM" and not fused
    p = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    t: dict[str, Target] = {p + "gate.weight": whole(moe.gate)}
    if moe.correction_bias is not None:
        t[p + "gate.e_score_correction_bias"] = whole(moe.correction_bias)
    if moe.shared_experts is not None:
        t.update(_mlp_targets(p + "shared_experts.", moe.shared_experts, layout))
    inter, full = moe.w2.shape[-1], cfg.moe_intermediate_size  # this rank's width, the whole
    i0 = layout.moe_tp_rank * inter
    first, count = local_experts(cfg.num_experts, layout)
    mine = slice(i0, i0 + inter)
    if fused:  # [E, 2I, hidden] and [E, hidden, I]: this rank's experts, gate and up rows
        experts = slice(first, first + count)
        up = slice(full + i0, full + i0 + inter)
        hidden = cfg.hidden_size
        t[p + "experts.gate_up_proj"] = Target(
            (cfg.num_experts, 2 * full, hidden),
            ((moe.w13[:, :inter], (experts, mine)), (moe.w13[:, inter:], (experts, up))))
        t[p + "experts.down_proj"] = Target((cfg.num_experts, hidden, full),
                                            ((moe.w2, (experts, slice(None), mine)),))
        return t
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(cfg.num_experts):
        local = e - first
        if not 0 <= local < count:  # another rank's: checked by shape, not read
            t[f"{p}experts.{e}.{gate}.weight"] = t[f"{p}experts.{e}.{up}.weight"] = Target(
                (full, cfg.hidden_size), ())
            t[f"{p}experts.{e}.{down}.weight"] = Target((cfg.hidden_size, full), ())
            continue
        t[f"{p}experts.{e}.{gate}.weight"] = rows(moe.w13[local, :inter], i0, full)
        t[f"{p}experts.{e}.{up}.weight"] = rows(moe.w13[local, inter:], i0, full)
        t[f"{p}experts.{e}.{down}.weight"] = rows(moe.w2[local], i0, full, dim=1)
    return t
