"""HF config.json -> ModelConfig, one parser per family. Torch-free: the API process reads it.

`parse(hf)` picks the parser by `architectures` (Kimi K2's `model_type: kimi_k2` is a
DeepseekV3ForCausalLM and parses as one). Each family's module lists the fields it honours or
checks; `fields.py` holds what they share (the common fields, the inert set, RoPE, refusals).
The model code (module trees) for each family lives in `moeserve/models/`; the parsing sits
here because the API process parses a checkpoint's config without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moeserve.config import ConfigError
from moeserve.hf_config import deepseek, glm, qwen3
from moeserve.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

PARSERS: dict[str, Callable[[dict[str, Any], str], ModelConfig]] = {
    "Qwen3ForCausalLM": qwen3.parse,
    "Qwen3MoeForCausalLM": qwen3.parse,
    "MixtralForCausalLM": qwen3.parse,
    "DeepseekV2ForCausalLM": deepseek.parse,
    "DeepseekV3ForCausalLM": deepseek.parse,
    "Glm4MoeForCausalLM": glm.parse,
    "Glm4MoeLiteForCausalLM": glm.parse,
    "GlmMoeDsaForCausalLM": glm.parse,
    "DeepseekV32ForCausalLM": deepseek.parse,
}
assert set(PARSERS) == set(SUPPORTED_ARCHITECTURES)


def parse(hf: dict[str, Any]) -> ModelConfig:
    """Build from a config.json dict; raise ConfigError naming any field we cannot serve."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in PARSERS:
        raise ConfigError(f"unknown architecture {archs!r}; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return PARSERS[archs[0]](hf, archs[0])
    except KeyError as e:
        raise ConfigError(f"config field {e.args[0]!r} is required for {archs[0]}") from None
