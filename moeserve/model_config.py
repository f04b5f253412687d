"""The model's shape, from its Hugging Face config.json: `ModelConfig` and its parts (RoPE,
MLA, DSA, the router), frozen and validated on construction, and `ConfigError`.

`ModelConfig.from_hf` hands the dict to moeserve/hf_config/ (one torch-free parser per family),
which rejects any field whose value we do not implement rather than serving it wrongly. The
engine's own knobs are in moeserve/config.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeserve.quant.spec import QuantSpec

SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM",
)
INDEXER_TYPES = ("full", "shared")


class ConfigError(ValueError):
    """A config (checkpoint or engine) that moeserve cannot serve correctly."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: which dims of a head rotate, in which layout, at which
    frequencies (transformers' default and YaRN inits)."""

    theta: float = 10000.0
    rotary_dim: int = 0
    """Dims of each head that rotate (the first ones; partial rotary when < the head's)."""
    interleaved: bool = False
    """Pairs (2i, 2i + 1) rotate together (DeepSeek, GLM MLA); else the halves (neox)."""
    rope_type: str = "default"
    """"default" or "yarn"."""
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    """YaRN: also scales the softmax (DeepSeek's mscale correction) when non-zero."""
    attention_factor: float | None = None
    """YaRN: the cos/sin multiplier; None = derived from factor and the mscales."""
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope type {self.rope_type!r} is not implemented")
        if self.rope_type == "yarn" and self.original_max_position_embeddings < 1:
            raise ConfigError("yarn rope needs original_max_position_embeddings >= 1")


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: K and V of every head are up-projected from one
    shared latent (kv_lora_rank) per token, cached with the token's rotary key part."""

    q_lora_rank: int | None
    """None: q_proj straight from the hidden state; else q_a_proj -> norm -> q_b_proj."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class DsaConfig:
    """DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2): a lightning indexer scores every
    earlier position for each query token and the MLA attends to the `index_topk` best.

    Indexer (per "full" layer): q_idx = wq_b(q_lora output) in `index_n_heads` heads of
    `index_head_dim`, one key LayerNorm(wk(x)) per token (cached beside the latent), RoPE on the
    first qk_rope_head_dim dims of both; score(t, s) = sum_h w_h(t) ReLU(q_h . k_s / sqrt(D)),
    w = weights_proj(x) / sqrt(heads). A "shared" layer reuses the selection of the last "full"
    layer before it and has no indexer (nor indexer cache) of its own."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_interleaved: bool
    """The indexer's RoPE: pairs (GLM-5) or halves (DeepSeek-V3.2); each model's own code."""
    indexer_types: tuple[str, ...]
    """"full" or "shared" per layer (at least num_layers entries; the first "full")."""

    def __post_init__(self) -> None:
        if min(self.index_n_heads, self.index_head_dim, self.index_topk) < 1:
            raise ConfigError(f"index_n_heads {self.index_n_heads}, index_head_dim "
                              f"{self.index_head_dim} and index_topk {self.index_topk} must "
                              "be >= 1")
        if set(self.indexer_types) - set(INDEXER_TYPES):
            raise ConfigError(f"indexer_types must list 'full' or 'shared' per layer, got "
                              f"{list(self.indexer_types)}")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ConfigError("indexer_types: the first entry must be 'full' (a 'shared' layer "
                              "reuses the selection of a 'full' layer before it)")

    def is_full(self, layer_idx: int) -> bool:
        """Whether the layer runs its own indexer (and has an indexer key cache)."""
        return self.indexer_types[layer_idx] == "full"

    def source_layer(self, layer_idx: int) -> int:
        """The full layer whose selection the layer attends with (itself when full)."""
        return max(i for i in range(layer_idx + 1) if self.indexer_types[i] == "full")

    def num_full_layers(self, num_layers: int) -> int:
        return sum(self.is_full(i) for i in range(num_layers))

    def indexer_params(self, hidden: int, q_lora_rank: int) -> int:
        """One full layer's indexer weights: wq_b, wk, k_norm (weight and bias), weights_proj."""
        d, heads = self.index_head_dim, self.index_n_heads
        return q_lora_rank * heads * d + hidden * d + 2 * d + hidden * heads


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How router logits become each token's experts and weights."""

    scoring: str = "softmax"
    """"softmax" (Qwen3-MoE, Mixtral, DeepSeek-V2) or "sigmoid" (DeepSeek-V3, GLM)."""
    topk_method: str = "greedy"
    """"greedy"; "group_limited_greedy" (V2: groups scored by their best expert);
    "noaux_tc" (V3, GLM: the correction bias steers the choice, groups scored by the sum of
    their two best)."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    logits_fp32: bool = False
    """The router's linear in fp32 (DeepSeek, GLM), not the activation dtype."""

    def __post_init__(self) -> None:
        ok = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
        if self.topk_method not in ok.get(self.scoring, ()):
            raise ConfigError(f"router scoring {self.scoring!r} with topk_method "
                              f"{self.topk_method!r} is not implemented")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group {self.topk_group} must be in 1..n_group "
                              f"{self.n_group}")

    @property
    def correction_bias(self) -> bool:
        """Whether the router has an e_score_correction_bias [E] (loaded with the weights)."""
        return self.topk_method == "noaux_tc"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The model's shape, from its HF config.json. `num_experts == 0` means a dense model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (Qwen3 dense layers)."""
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    """Expert width."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1."""
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qk_norm: bool = False
    """Qwen3's RMSNorm on each head of q and k before RoPE."""
    qkv_bias: bool = False
    """Biases on q, k and v (GLM-4.5's attention_bias)."""
    mla: MlaConfig | None = None
    """Multi-head latent attention (DeepSeek, GLM-4.7-Flash); None: GQA."""
    dsa: DsaConfig | None = None
    """DeepSeek Sparse Attention over the MLA (GLM-5, DeepSeek-V3.2); None: dense."""
    router: RouterConfig = field(default_factory=RouterConfig)
    shared_expert_intermediate_size: int = 0
    """Width of the shared experts' one MLP beside the routed ones (0: none)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint carries after the decoder layers (kept
    aside for speculative decoding; not run)."""
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "bfloat16"
    tokenizer: str | None = None
    """Built-in tokenizer name for presets without tokenizer files ("byte")."""
    quantization: QuantSpec | None = None
    """The checkpoint's quantized format (moeserve/quant/spec.py); None: unquantized. Such
    weights are held quantized (quant/plan.py, runner/weights/quant.py)."""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                              f"[1, {self.num_experts}]")
        if self.num_experts and self.num_experts % self.router.n_group:
            raise ConfigError(f"n_group {self.router.n_group} must divide the "
                              f"{self.num_experts} experts")
        if self.dsa is not None:
            if self.mla is None or not self.mla.q_lora_rank:
                raise ConfigError("DSA needs MLA with q_lora_rank: the indexer's queries come "
                                  "from the q_lora output")
            if self.dsa.index_head_dim < self.mla.qk_rope_head_dim:
                raise ConfigError(f"index_head_dim {self.dsa.index_head_dim} must be >= "
                                  f"qk_rope_head_dim {self.mla.qk_rope_head_dim} (the indexer "
                                  "rotates that many dims)")
            if len(self.dsa.indexer_types) < self.num_layers:
                raise ConfigError(f"indexer_types lists {len(self.dsa.indexer_types)} layers, "
                                  f"fewer than num_hidden_layers {self.num_layers}")

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the MLA rope part, or the GQA head's share)."""
        if self.rope.rotary_dim:
            return self.rope.rotary_dim
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule; Mixtral has every layer sparse (decoder_sparse_step 1)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_bytes_per_token_per_layer_elem(self) -> int:
        """Cached elements per token per layer: K and V of each KV head (GQA), or the latent
        and the rotary key (MLA). DSA's indexer keys are counted apart
        (`index_cache_layers`)."""
        if self.mla is not None:
            return self.mla.latent_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def index_cache_layers(self) -> int:
        """Layers with a DSA indexer key cache (the "full" ones; 0 without DSA)."""
        return 0 if self.dsa is None else self.dsa.num_full_layers(self.num_layers)

    def cache_elems_per_token(self, indexer_cache: bool = True) -> int:
        """Cached elements per token over all layers: the attention cache of every layer, and
        (indexer_cache) DSA's index_head_dim key of each full layer."""
        total = self.num_layers * self.kv_bytes_per_token_per_layer_elem
        if indexer_cache and self.dsa is not None:
            total += self.index_cache_layers * self.dsa.index_head_dim
        return total

    def attention_params(self) -> int:
        """One layer's attention weights."""
        h, d, heads = self.hidden_size, self.head_dim, self.num_heads
        m = self.mla
        if m is None:
            bias = (heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
            return (h * d * (heads * 2 + self.num_kv_heads * 2) + bias
                    + (2 * d if self.qk_norm else 0))
        q = (h * heads * m.qk_head_dim if m.q_lora_rank is None else
             h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim)
        kv = (h * m.latent_dim + m.kv_lora_rank
              + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim))
        return q + kv + heads * m.v_head_dim * h

    def num_params(self) -> int:
        """Parameter count of the served model, from the shapes alone (MTP layers excluded)."""
        h = self.hidden_size
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        if self.dsa is not None:
            assert self.mla is not None and self.mla.q_lora_rank
            total += self.index_cache_layers * self.dsa.indexer_params(h, self.mla.q_lora_rank)
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                mlp = (self.num_experts * (3 * h * self.moe_intermediate_size + h)
                       + 3 * h * self.shared_expert_intermediate_size)
                if self.router.correction_bias:
                    mlp += self.num_experts
            else:
                mlp = 3 * h * self.intermediate_size
            total += self.attention_params() + mlp + 2 * h
        return total

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (moeserve/hf_config/: one parser per family); raise
        ConfigError naming any field we cannot serve."""
        from moeserve.hf_config import parse

        return parse(hf)

    @classmethod
    def from_file(cls, path: str) -> ModelConfig:
        return cls.from_hf(read_json_config(path))


def read_json_config(path: str) -> dict[str, Any]:
    """A config.json file as a dict; ConfigError when it is not a JSON object."""
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} holds a JSON {type(hf).__name__}, not an object")
    return hf
