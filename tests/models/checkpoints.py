"""Tiny random HF checkpoints written by transformers itself, for tests (reused by end-to-end
tests). Dimensions are multiples of 8 (torch._grouped_mm needs 16-byte strides) and weights use
initializer_range 0.1 with randomised norm weights, so logits are peaked and a mixed-up weight
shows. Each folder also gets a byte-level tokenizer.json (256 byte tokens, no merges), so it is
a complete checkpoint that the engine can serve from text.

    path = write_tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", sharded=True, norm_topk_prob=False)
    hf = load_hf_model(path);  ref = hf_logits(hf, [3, 1, 4, 1, 5])   # [5, vocab] fp32
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV32Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmMoeDsaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3MoeConfig,
)

ARCHS = ("qwen3_moe", "qwen3", "mixtral", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe",
         "glm4_moe_lite", "glm_moe_dsa", "deepseek_v32")
# MLA dims of the tiny DeepSeek / GLM-4.7-Flash checkpoints (latent 32 + rope 16)
_MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "num_key_value_heads": 4}
_DEEPSEEK_MOE = {"intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_shared_experts": 2}
# Fields published DeepSeek / Kimi / GLM configs carry that transformers never writes: the
# tiny checkpoints carry them too, so a real checkpoint does not fail where the tests passed.
PUBLISHED_EXTRA: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1, "moe_layer_freq": 1,
                    "scoring_func": "softmax", "auto_map": {
                        "AutoConfig": "configuration_deepseek.DeepseekV2Config"}},
    "deepseek_v3": {"aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1, "moe_layer_freq": 1,
                    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "auto_map": {
                        "AutoConfig": "configuration_deepseek.DeepseekV3Config"}},
}
PUBLISHED_EXTRA["kimi_k2"] = PUBLISHED_EXTRA["deepseek_v3"]
PUBLISHED_EXTRA["deepseek_v32"] = {"ep_size": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid",
                                   "topk_method": "noaux_tc"}
PUBLISHED_EXTRA["glm_moe_dsa"] = {"ep_size": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid",
                                  "topk_method": "noaux_tc", "pretraining_tp": 1,
                                  "rope_interleave": True, "indexer_rope_interleave": True}
# The DSA indexer of the tiny GLM-5 / DeepSeek-V3.2 checkpoints: top 8 positions, so prompts of
# 16 to 128 tokens really select (a context of at most 8 selects everything)
_DSA = {"index_topk": 8, "index_head_dim": 32, "q_lora_rank": 24}

_COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.1,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}
_DEFAULTS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "qwen3_moe": (Qwen3MoeConfig, {
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "mlp_only_layers": [1], "norm_topk_prob": True,
        "decoder_sparse_step": 1}),
    "qwen3": (Qwen3Config, {"intermediate_size": 96}),
    "mixtral": (MixtralConfig, {"intermediate_size": 32, "num_local_experts": 8,
                                "num_experts_per_tok": 2}),
    # V2: no q_lora, group-limited greedy softmax routing, no renormalisation
    "deepseek_v2": (DeepseekV2Config, {**_MLA, **_DEEPSEEK_MOE, "q_lora_rank": None,
                                       "topk_method": "group_limited_greedy", "n_group": 4,
                                       "topk_group": 2, "routed_scaling_factor": 1.5}),
    # V3: q_lora, YaRN, n_group 4 > topk_group 2, two shared experts, a dense first layer, MTP
    "deepseek_v3": (DeepseekV3Config, {**_MLA, **_DEEPSEEK_MOE, "q_lora_rank": 24, "n_group": 4,
                                       "topk_group": 2, "routed_scaling_factor": 2.5,
                                       "num_nextn_predict_layers": 1, "rope_parameters": {
                                           "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                           "original_max_position_embeddings": 128,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                           "mscale_all_dim": 1.0}}),
    # Kimi K2: a DeepseekV3 checkpoint whose config says model_type kimi_k2 (patched on write)
    "kimi_k2": (DeepseekV3Config, {**_MLA, **_DEEPSEEK_MOE, "q_lora_rank": 24, "n_group": 1,
                                   "topk_group": 1, "routed_scaling_factor": 2.827,
                                   "n_shared_experts": 1}),
    # GLM-4.5: GQA, partial rotary 0.5, qkv bias, q/k norm, a shared expert, sigmoid router
    "glm4_moe": (Glm4MoeConfig, {"intermediate_size": 96, "moe_intermediate_size": 32,
                                 "n_routed_experts": 8, "num_experts_per_tok": 2,
                                 "n_shared_experts": 1, "first_k_dense_replace": 1,
                                 "attention_bias": True, "use_qk_norm": True,
                                 "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5,
                                 "n_group": 2, "topk_group": 1}),
    # GLM-4.7-Flash: MLA with v wider than nope, interleaved RoPE, mlp_layer_types
    "glm4_moe_lite": (Glm4MoeLiteConfig, {**_MLA, "qk_nope_head_dim": 16, "v_head_dim": 32,
                                          "q_lora_rank": 24, "intermediate_size": 96,
                                          "moe_intermediate_size": 32, "n_routed_experts": 8,
                                          "num_experts_per_tok": 2, "n_shared_experts": 1,
                                          "routed_scaling_factor": 1.8,
                                          "mlp_layer_types": ["dense", "sparse", "sparse"]}),
    # GLM-5: MLA + DSA, interleaved indexer RoPE, layer 1 "shared" (reuses layer 0's top-k)
    "glm_moe_dsa": (GlmMoeDsaConfig, {**_MLA, **_DEEPSEEK_MOE, **_DSA, "index_n_heads": 8,
                                      "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                                      "indexer_types": ["full", "shared", "full"],
                                      "rope_parameters": {"rope_type": "default",
                                                          "rope_theta": 1e6}}),
    # DeepSeek-V3.2: V3's MLA, YaRN and grouped router + DSA with a half-split indexer RoPE;
    # every layer full (the tests add an MTP layer)
    "deepseek_v32": (DeepseekV32Config, {**_MLA, **_DEEPSEEK_MOE, **_DSA, "index_n_heads": 16,
                                         "n_group": 4, "topk_group": 2,
                                         "routed_scaling_factor": 2.5,
                                         "num_nextn_predict_layers": 1, "rope_parameters": {
                                             "rope_type": "yarn", "factor": 4.0,
                                             "rope_theta": 1e4,
                                             "original_max_position_embeddings": 128,
                                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                             "mscale_all_dim": 1.0}}),
}


def tiny_hf_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The HF config of a tiny model of `arch` ("qwen3_moe", "qwen3", "mixtral")."""
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; one of {', '.join(ARCHS)}")
    cls, defaults = _DEFAULTS[arch]
    return cls(**{**_COMMON, **defaults, **overrides})


def write_tiny_checkpoint(arch: str, path: str | os.PathLike, sharded: bool = False,
                          seed: int = 0, fused_experts: bool = False, tokenizer: bool = True,
                          **overrides: Any) -> str:
    """Write a random fp32 model of `arch` with save_pretrained (safetensors); return the folder.

    Args:
        sharded: split into several shard files plus model.safetensors.index.json.
        fused_experts: write experts as `mlp.experts.gate_up_proj` / `down_proj` (transformers'
            in-memory layout, save_original_format=False) instead of one tensor per expert.
        tokenizer: also write a byte-level tokenizer.json (see write_byte_tokenizer).
        overrides: HF config fields (e.g. norm_topk_prob=False, num_hidden_layers=2).
    """
    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # HF inits them to 1: make a swap detectable
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    path = os.fspath(path)
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "10GB",
                          save_original_format=not fused_experts)
    _publish_fields(arch, path)
    if tokenizer:
        write_byte_tokenizer(path)
    return path


def _publish_fields(arch: str, path: str) -> None:
    """Give config.json the fields the published checkpoints of `arch` carry (and Kimi K2's
    model_type), which transformers' save_pretrained never writes."""
    import json

    extra = dict(PUBLISHED_EXTRA.get(arch, {}))
    if arch == "kimi_k2":
        extra["model_type"] = "kimi_k2"
    if not extra:
        return
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    with open(file, "w") as f:
        json.dump({**config, **extra}, f, indent=2)


def write_mtp_tensors(path: str | os.PathLike, num_layers: int, hidden: int, seed: int = 0) -> int:
    """Add one multi-token-prediction layer's tensors (model.layers.<num_layers>.*: enorm,
    hnorm, eh_proj, embed_tokens, shared_head.{norm,head} and a decoder layer's norms) as an
    extra shard in the index (transformers has no MTP module, so tests write them). Returns the
    number of tensors written."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    p = f"model.layers.{num_layers}."
    tensors = {p + "enorm.weight": torch.ones(hidden), p + "hnorm.weight": torch.ones(hidden),
               p + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
               p + "embed_tokens.weight": torch.randn(8, hidden, generator=gen),
               p + "shared_head.norm.weight": torch.ones(hidden),
               p + "shared_head.head.weight": torch.randn(8, hidden, generator=gen),
               p + "input_layernorm.weight": torch.ones(hidden),
               p + "post_attention_layernorm.weight": torch.ones(hidden)}
    folder = os.fspath(path)
    save_file(tensors, os.path.join(folder, "model-mtp.safetensors"))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            doc = json.load(f)
    else:  # a single-file checkpoint becomes an indexed one
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            doc = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    doc["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    with open(index, "w") as f:
        json.dump(doc, f)
    return len(tensors)


def write_byte_tokenizer(path: str | os.PathLike) -> str:
    """Write tokenizer.json: GPT-2 style byte-level BPE whose vocabulary is the 256 bytes (id =
    byte value) with no merges and no special tokens, so any id below 256 decodes. Returns the
    file path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    file = os.path.join(os.fspath(path), "tokenizer.json")
    tok.save(file)
    return file


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character map used by byte-level BPE."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + n) for n, b in enumerate(extra)}}


def hf_config_as_published(path: str | os.PathLike) -> PretrainedConfig | None:
    """The transformers config to load a checkpoint folder with, or None for AutoConfig's own.
    A published DeepSeek / Kimi config points at remote code (auto_map) or names a model_type
    transformers does not know (kimi_k2): load it with the architecture's own class, as a user
    of transformers would."""
    import json

    with open(os.path.join(os.fspath(path), "config.json")) as f:
        published = json.load(f)
    if "auto_map" not in published and published.get("model_type") != "kimi_k2":
        return None
    cls = {"DeepseekV2ForCausalLM": DeepseekV2Config,
           "DeepseekV3ForCausalLM": DeepseekV3Config}[published["architectures"][0]]
    config = cls.from_pretrained(os.fspath(path))
    config.auto_map = {}
    # transformers picks the expert-weight conversion by model_type: a kimi_k2 checkpoint is a
    # DeepseekV3 one, so load it as one (else its experts stay uninitialised)
    config.model_type = cls.model_type
    return config


def load_hf_model(path: str | os.PathLike) -> PreTrainedModel:
    """transformers' own model for a checkpoint folder: fp32, eval, eager attention."""
    config = hf_config_as_published(path)
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), config=config,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence: [len(token_ids), vocab] fp32."""
    return model(torch.tensor([token_ids])).logits[0].float()
