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
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3MoeConfig,
)

ARCHS = ("qwen3_moe", "qwen3", "mixtral")

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
    if tokenizer:
        write_byte_tokenizer(path)
    return path


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


def load_hf_model(path: str | os.PathLike) -> PreTrainedModel:
    """transformers' own model for a checkpoint folder: fp32, eval, eager attention."""
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence: [len(token_ids), vocab] fp32."""
    return model(torch.tensor([token_ids])).logits[0].float()
