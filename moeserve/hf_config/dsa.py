"""DeepSeek Sparse Attention's config.json fields, shared by GLM-5 (`GlmMoeDsaForCausalLM`,
parsed in glm.py) and DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, parsed in deepseek.py).

Honoured: `index_n_heads`, `index_head_dim`, `index_topk`; GLM-5's per-layer indexer modes
`indexer_types` ("full" / "shared"), or when absent the schedule transformers derives them from
(`index_topk_pattern`, else `index_topk_freq` / `index_skip_topk_offset`: every layer "full" at
their defaults, which is GLM-5's published config); `mlp_layer_types`, else
`first_k_dense_replace` (default 3) dense layers first, as both transformers configs do.
Checked: `layer_types` (transformers writes "deepseek_sparse_attention" for every layer),
`mlp_bias` false, and the RoPE layouts transformers implements whatever the config says: the
main attention interleaved in both (`rope_interleave` true), the indexer interleaved in GLM-5
and half-split in V3.2 (`indexer_rope_interleave` true / false). Inert: INERT below.
"""

from __future__ import annotations

from typing import Any

from moeserve.config import ConfigError
from moeserve.hf_config import fields
from moeserve.model_config import DsaConfig

INERT: dict[str, str] = {
    "index_share_for_mtp_iteration": "how the MTP layers reuse the indexer; MTP layers are not "
                                      "served",
}
FIELDS = frozenset({"index_n_heads", "index_head_dim", "index_topk", "layer_types",
                    "mlp_layer_types", "mlp_bias", "rope_interleave",
                    "indexer_rope_interleave"}) | frozenset(INERT)
# GLM-5's per-layer indexer modes and the schedule they are derived from
GLM_INDEXER = frozenset({"indexer_types", "index_topk_pattern", "index_topk_freq",
                         "index_skip_topk_offset"})


def dsa_config(hf: dict[str, Any], *, glm: bool) -> DsaConfig:
    """The indexer of a GLM-5 (glm) or DeepSeek-V3.2 config; checks the layouts and layer
    types transformers implements."""
    n = hf["num_hidden_layers"]
    fields.check_value(hf, "rope_interleave", (True,))
    fields.check_value(hf, "indexer_rope_interleave", (glm,))
    fields.check_value(hf, "mlp_bias", (False,))
    layer_types = hf.get("layer_types")
    if layer_types is not None and set(layer_types) != {"deepseek_sparse_attention"}:
        raise ConfigError(f"layer_types other than deepseek_sparse_attention are not "
                          f"implemented: {sorted(set(layer_types))}")
    return DsaConfig(index_n_heads=hf.get("index_n_heads", 32 if glm else 64),
                     index_head_dim=hf.get("index_head_dim", 128),
                     index_topk=hf.get("index_topk", 2048), rope_interleaved=glm,
                     indexer_types=indexer_types(hf, n) if glm else ("full",) * n)


def indexer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """GlmMoeDsaConfig's per-layer modes: `indexer_types`, else `index_topk_pattern` ("F" /
    "S" per layer, or a list), else "full" where max(i - offset + 1, 0) % freq == 0 with
    `index_topk_freq` (default 1) and `index_skip_topk_offset` (default 2)."""
    if hf.get("indexer_types") is not None:
        return tuple(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                raise ConfigError(f"index_topk_pattern must be made of 'F' and 'S', got "
                                  f"{pattern!r}")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(hf.get("index_topk_freq", 1)), 1)
    offset = int(hf.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(num_layers))


def dense_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """The dense-MLP layers: `mlp_layer_types` ("dense" / "sparse" per layer; transformers
    reads the first num_hidden_layers entries), else the first `first_k_dense_replace`
    (default 3). Both given and disagreeing is refused rather than guessed."""
    n = hf["num_hidden_layers"]
    k = hf.get("first_k_dense_replace")
    types = hf.get("mlp_layer_types")
    if types is None:
        return tuple(range(min(3 if k is None else k, n)))
    if len(types) < n or set(types) - {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {n} "
                          f"layers, got {types}")
    dense = tuple(i for i, t in enumerate(types[:n]) if t == "dense")
    if k is not None and dense != tuple(range(min(k, n))):
        raise ConfigError(f"first_k_dense_replace {k} disagrees with mlp_layer_types "
                          f"(dense layers {list(dense)}); transformers follows mlp_layer_types")
    return dense
