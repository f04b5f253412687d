"""Tiny checkpoints shared by the model tests, written once per session."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from transformers import PreTrainedModel

from tests.models.checkpoints import load_hf_model, write_tiny_checkpoint

# variant -> (arch, sharded, HF config overrides)
VARIANTS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "qwen3_moe_norm": ("qwen3_moe", True, {"norm_topk_prob": True, "mlp_only_layers": [0]}),
    "qwen3_moe_nonorm": ("qwen3_moe", False, {"norm_topk_prob": False, "mlp_only_layers": [1]}),
    "qwen3_moe_step2": ("qwen3_moe", False, {"decoder_sparse_step": 2, "mlp_only_layers": []}),
    "qwen3_tied": ("qwen3", False, {"tie_word_embeddings": True}),
    "mixtral": ("mixtral", False, {}),
    "qwen3_yarn": ("qwen3", False, {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 1e6}}),
    "deepseek_v2": ("deepseek_v2", False, {}),
    "deepseek_v3": ("deepseek_v3", True, {}),
    "kimi_k2": ("kimi_k2", False, {}),
    "glm4_moe": ("glm4_moe", False, {}),
    "glm4_moe_lite": ("glm4_moe_lite", False, {}),
    "glm_moe_dsa": ("glm_moe_dsa", False, {}),
    "deepseek_v32": ("deepseek_v32", True, {}),
}
MLA_VARIANTS = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "glm_moe_dsa",
                "deepseek_v32")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """variant name -> folder of its checkpoint (written on first use)."""
    cache: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in cache:
            arch, sharded, overrides = VARIANTS[variant]
            cache[variant] = write_tiny_checkpoint(arch, tmp_path_factory.mktemp(variant),
                                                   sharded=sharded, **overrides)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Callable[[str], str]) -> Callable[[str], PreTrainedModel]:
    """variant name -> transformers' model of that checkpoint (fp32, eval)."""
    cache: dict[str, PreTrainedModel] = {}

    def get(variant: str) -> PreTrainedModel:
        if variant not in cache:
            cache[variant] = load_hf_model(tiny_checkpoint(variant))
        return cache[variant]

    return get
