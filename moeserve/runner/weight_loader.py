"""Weights: HF safetensors checkpoints into our packed parameters, or random dummy weights.

`load_weights` reads `model.safetensors`, or the shards listed by `model.safetensors.index.json`,
one tensor at a time (safe_open + get_tensor, copied and dtype-converted into the preallocated
parameters, so peak memory stays about 1x the model). The name map is strict: every expected
tensor must be present with its exact shape, and nothing else may be there; any mismatch raises
WeightLoadError naming the tensor, before anything is copied.

HF name (model.layers.{i}.)                         -> our parameter
    self_attn.{q,k,v}_proj.weight                   -> self_attn.qkv_proj rows [q | k | v]
    self_attn.{o_proj,q_norm,k_norm}.weight         -> self_attn.{o_proj, q_norm.weight, ...}
    mlp.{gate,up}_proj.weight, mlp.down_proj.weight -> mlp.gate_up_proj rows [gate | up], down_proj
    mlp.experts.{e}.{gate,up,down}_proj.weight   -> mlp.w13[e, :I], w13[e, I:], w2[e] (Qwen3-MoE)
    block_sparse_moe.experts.{e}.{w1,w3,w2}.weight  -> mlp.w13[e, :I], w13[e, I:], w2[e]  (Mixtral)
    mlp.experts.{gate_up_proj,down_proj}            -> mlp.w13, mlp.w2   (fused layout, written by
                                                       save_pretrained(save_original_format=False))
    {mlp,block_sparse_moe}.gate.weight              -> mlp.gate (router)
lm_head.weight is skipped when the embeddings are tied.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from safetensors import safe_open

from moeserve.config import ModelConfig
from moeserve.layers.attention import Attention
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import SparseMoeBlock
from moeserve.layers.norm import RMSNorm
from moeserve.models.qwen3_moe import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old checkpoints carry
_DUMMY_STD = 0.02


class WeightLoadError(ValueError):
    """A checkpoint whose tensors do not match the model (names the tensor or file)."""


@torch.no_grad()
def load_weights(model: CausalLM, model_config: ModelConfig, folder: str) -> None:
    """Copy the checkpoint in `folder` into `model`'s parameters (strict; see module doc)."""
    files = _checkpoint_files(folder)  # tensor name -> file path
    targets = _weight_targets(model, model_config, set(files))  # tensor name -> destination
    skipped = {n for n in files if n.endswith(_IGNORED_SUFFIXES)}
    if model_config.tie_word_embeddings:
        skipped.add("lm_head.weight")
    _check_names(set(targets), set(files) - skipped, folder)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    for path, names in by_file.items():  # pass 1: headers only, fail before copying anything
        with safe_open(path, framework="pt", device="cpu") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise WeightLoadError(f"{INDEX_FILE} puts tensor {name} in {path}, "
                                          "which does not contain it")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(targets[name].shape):
                    raise WeightLoadError(
                        f"tensor {name} has shape {list(shape)} in {path}; the model expects "
                        f"{list(targets[name].shape)}")
    for path, names in by_file.items():  # pass 2: copy, one tensor at a time
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                targets[name].copy_(f.get_tensor(name))


def _checkpoint_files(folder: str) -> dict[str, str]:
    """Map every tensor name in the checkpoint to the file holding it."""
    index_path = os.path.join(folder, INDEX_FILE)
    single_path = os.path.join(folder, SINGLE_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        for shard in sorted(set(weight_map.values())):
            if not os.path.exists(os.path.join(folder, shard)):
                raise WeightLoadError(f"shard file {shard} listed in {index_path} is missing")
        return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
    if os.path.exists(single_path):
        with safe_open(single_path, framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), single_path)
    raise WeightLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")


def _check_names(expected: set[str], found: set[str], folder: str) -> None:
    for what, names in (("missing", expected - found), ("unexpected", found - expected)):
        if names:
            shown = sorted(names)
            more = f" (and {len(shown) - 8} more)" if len(shown) > 8 else ""
            raise WeightLoadError(f"{what} tensor(s) in the checkpoint {folder}: "
                                  f"{', '.join(shown[:8])}{more}")


def _weight_targets(model: CausalLM, cfg: ModelConfig,
                    names: set[str]) -> dict[str, torch.Tensor]:
    """HF tensor name -> the parameter (or the slice of a packed one) it is copied into."""
    m = model.model
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": m.embed_tokens,
                                  "model.norm.weight": m.norm.weight}
    if model.lm_head is not None:
        t["lm_head.weight"] = model.lm_head
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        t[p + "self_attn.q_proj.weight"] = attn.qkv_proj[:q]
        t[p + "self_attn.k_proj.weight"] = attn.qkv_proj[q:q + kv]
        t[p + "self_attn.v_proj.weight"] = attn.qkv_proj[q + kv:]
        t[p + "self_attn.o_proj.weight"] = attn.o_proj
        if attn.q_norm is not None:
            t[p + "self_attn.q_norm.weight"] = attn.q_norm.weight
            t[p + "self_attn.k_norm.weight"] = attn.k_norm.weight
        t[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        t[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        if isinstance(layer.mlp, MLP):
            inter = layer.mlp.intermediate_size
            t[p + "mlp.gate_proj.weight"] = layer.mlp.gate_up_proj[:inter]
            t[p + "mlp.up_proj.weight"] = layer.mlp.gate_up_proj[inter:]
            t[p + "mlp.down_proj.weight"] = layer.mlp.down_proj
        else:
            t.update(_expert_targets(p, layer.mlp, cfg, names))
    return t


def _expert_targets(prefix: str, moe: SparseMoeBlock, cfg: ModelConfig,
                    names: set[str]) -> dict[str, torch.Tensor]:
    if prefix + "mlp.experts.gate_up_proj" in names:  # fused layout
        return {prefix + "mlp.gate.weight": moe.gate,
                prefix + "mlp.experts.gate_up_proj": moe.w13,  # [E, 2I, hidden]
                prefix + "mlp.experts.down_proj": moe.w2}  # [E, hidden, I]
    if cfg.architecture == "MixtralForCausalLM":
        p, (gate, up, down) = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        p, (gate, up, down) = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    inter = cfg.moe_intermediate_size
    t: dict[str, torch.Tensor] = {p + "gate.weight": moe.gate}
    for e in range(cfg.num_experts):
        t[f"{p}experts.{e}.{gate}.weight"] = moe.w13[e, :inter]
        t[f"{p}experts.{e}.{up}.weight"] = moe.w13[e, inter:]
        t[f"{p}experts.{e}.{down}.weight"] = moe.w2[e]
    return t


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights on the model's own device (no CPU round trip), finite through deep stacks,
    with hidden states that stay distinct per token, so routing spreads as in a trained model.

        embed_tokens ~ N(0, 1)       the token's identity dominates the residual stream
        o_proj, down_proj, w2 ~ N(0, 0.002)   small residual writes: 48 layers add ~rms 1, so
                                      attention's averaging over the context cannot make all
                                      tokens alike (at 0.02 everywhere, 40 of 128 experts get
                                      the tokens of the last layers)
        routers ~ N(0, 1/sqrt(hidden))  unit-RMS input -> logits of std ~1
        norms = 1; everything else ~ N(0, 0.02)
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    std: dict[int, float] = {id(model.model.embed_tokens): 1.0}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            std[id(module.weight)] = 0.0  # filled with ones
        elif isinstance(module, SparseMoeBlock):
            std[id(module.gate)] = module.gate.shape[1] ** -0.5
            std[id(module.w2)] = _DUMMY_STD / 10
        elif isinstance(module, MLP):
            std[id(module.down_proj)] = _DUMMY_STD / 10
        elif isinstance(module, Attention):
            std[id(module.o_proj)] = _DUMMY_STD / 10
    for param in model.parameters():
        s = std.get(id(param), _DUMMY_STD)
        if s == 0.0:
            param.fill_(1.0)
        else:
            param.normal_(0.0, s, generator=gen)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
