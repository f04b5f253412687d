"""What every family's parser shares: the common fields, the field sets, RoPE, the refusals.

A config.json field is in exactly one of three states for an architecture: honoured (its parser
reads it), checked (accepted only at the value we implement; any other value is refused with its
name), or inert (changes nothing at inference: training knobs, bookkeeping, remote-code hooks),
listed with the reason here (every architecture) or in the family's module. Anything else is
refused by name: a real checkpoint fails loudly, never silently. `quantization_config` is parsed
by moeserve/quant/spec.py into ModelConfig.quantization (FP8 block-scaled, NVFP4, INT4; the
loader dequantizes such weights at load for now).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from moeserve.config import ConfigError
from moeserve.model_config import RopeConfig
from moeserve.quant.spec import QuantSpec, parse

# Fields that do not change inference, for every architecture: field -> why.
INERT: dict[str, str] = {
    "architectures": "read by hf_config.parse to pick the parser",
    "model_type": "transformers' config class; the parser follows `architectures` (Kimi K2's "
                  "kimi_k2 is a DeepseekV3ForCausalLM)",
    "transformers_version": "bookkeeping: the version that wrote the file",
    "dtype": "the checkpoint's dtype; ModelConfig.checkpoint_dtype records it, the engine's "
             "`dtype` decides",
    "torch_dtype": "transformers 4's name for `dtype`",
    "initializer_range": "training: the std of the random init",
    "use_cache": "transformers' generate() switch; the engine always caches",
    "output_router_logits": "training: returns router logits for the aux loss",
    "router_aux_loss_coef": "training: the auxiliary balance-loss weight",
    "router_jitter_noise": "training: noise on the router input",
    "attention_dropout": "training: dropout, off at inference",
    "pad_token_id": "batching pad of transformers; the engine packs tokens and never pads",
    "_name_or_path": "bookkeeping: where transformers loaded the config from",
    "auto_map": "remote-code hooks (trust_remote_code); moeserve runs its own model code",
    "pretraining_tp": "pretraining's tensor-parallel degree: transformers' Llama splits the "
                      "same matmuls into that many slices, the same maths",
}
# Read by `common` for every architecture.
COMMON = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
    "max_position_embeddings", "bos_token_id", "eos_token_id", "hidden_act",
    "rope_scaling", "rope_parameters", "rope_theta", "tie_word_embeddings",
})
# moeserve's own preset fields (ignored by transformers).
PRESET = frozenset({"moeserve_tokenizer", "moeserve_description"})


def check_known(hf: dict[str, Any], arch: str, known: Collection[str]) -> None:
    """Refuse, by name, every field that is neither honoured, checked nor inert; a quantized
    checkpoint first, with its own message (`quantization_config: null` is no quantization)."""
    unknown = sorted(set(hf) - set(INERT) - COMMON - PRESET - set(known)
                     - {"quantization_config"})
    if unknown:
        raise ConfigError(f"config field(s) not implemented for {arch}: {', '.join(unknown)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not implemented (only silu)")


def check_value(hf: dict[str, Any], key: str, allowed: tuple[Any, ...]) -> None:
    """A field accepted only at the values whose maths we implement (absent is allowed)."""
    if key in hf and hf[key] not in allowed:
        raise ConfigError(f"{key}={hf[key]!r} is not implemented (only "
                          f"{' or '.join(repr(a) for a in allowed)})")


def common(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way."""
    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return {
        "architecture": arch,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
        "intermediate_size": hf["intermediate_size"],
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": hf.get("max_position_embeddings", 32768),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_ids": eos_ids,
        "checkpoint_dtype": str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"),
        "tokenizer": hf.get("moeserve_tokenizer"),
        "quantization": quantization(hf),
    }


def quantization(hf: dict[str, Any]) -> QuantSpec | None:
    """The checkpoint's quantization_config, checked field by field (quant/spec.py)."""
    return parse(hf)


_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate"}


def rope(hf: dict[str, Any], head_dim: int, *, interleaved: bool = False) -> RopeConfig:
    """RoPE from `rope_parameters` (transformers 5) or the published `rope_scaling` +
    `rope_theta`, over `head_dim` dims (times `partial_rotary_factor`). Default and YaRN RoPE
    are implemented; any other type, or an unknown key, is refused by name."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key):
            params.update(hf[key])
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor {partial} x head dim {head_dim} gives "
                          f"{rotary_dim} rotary dims; RoPE needs an even number >= 2")
    allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if kind == "yarn":
        allowed |= _YARN_KEYS
    elif kind != "default":
        raise ConfigError(f"rope type {kind!r} is not implemented (only default and yarn)")
    extra = set(params) - allowed
    if extra:
        raise ConfigError(f"rope field(s) not implemented for rope type {kind!r}: "
                          f"{', '.join(sorted(extra))}")
    if kind == "default":
        return RopeConfig(theta=theta, rotary_dim=rotary_dim, interleaved=interleaved)
    max_pos = hf.get("max_position_embeddings", 32768)
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("yarn rope needs original_max_position_embeddings")
    factor = params.get("factor")
    return RopeConfig(
        theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, rope_type="yarn",
        factor=float(factor if factor is not None else max_pos / original),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=(None if params.get("attention_factor") is None
                          else float(params["attention_factor"])),
        truncate=bool(params.get("truncate", True)))


def no_sliding_window(hf: dict[str, Any]) -> None:
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise ConfigError(f"sliding_window={hf['sliding_window']} is not implemented")
    if any(t != "full_attention" for t in hf.get("layer_types") or ()):
        raise ConfigError(f"layer_types other than full_attention are not implemented: "
                          f"{sorted(set(hf['layer_types']))}")
