"""Engine configuration: frozen dataclasses, validated on construction.

ModelConfig is built once from a Hugging Face config.json (checkpoint or preset) by
`ModelConfig.from_hf`, which rejects any field whose value we do not implement rather than
serving it wrongly. The other configs hold the user's knobs; a knob may be "auto", and
`resolve_static` turns those into values with a reason for each (the capacity report prints the
reasons). Figures found at run time (KV blocks, the admission cap) are returned by the runner and
`resolve_max_running_requests`, never written back into a config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    mem_fraction: float = 0.90
    """Share of the GPU's total memory the engine may use (weights, activations, KV, graphs)."""
    cpu_kv_cache_bytes: int = 256 << 20
    """KV budget in bytes when running on CPU."""
    num_blocks: int | None = None
    """Force the number of KV blocks (tests, debugging); None sizes it from memory."""
    enable_prefix_caching: bool = True
    """Reuse KV of full blocks whose token prefix was seen before."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is the null block), "
                              f"got {self.num_blocks}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching and admission."""

    max_num_batched_tokens: int = 8192
    """Token budget of one step (prefill chunks + decodes)."""
    max_running_requests: int | str = "auto"
    """Cap on running requests; "auto" = min(request_pool, KV tokens // expected tokens)."""
    request_pool: int = 4096
    """Upper bound on running requests under "auto"."""
    expected_tokens_per_request: int = 256
    """Footprint (prompt + output tokens) assumed by the "auto" admission cap."""
    max_model_len: int | str = "auto"
    """Longest prompt + output; "auto" = the model's max_position_embeddings."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step's remaining budget over several steps."""
    watermark: float = 0.01
    """Share of KV blocks kept free when admitting a new request."""
    num_continuous_decode_steps: int = 1
    """Decode steps run back to back when a step is decode-only (fewer scheduling rounds)."""
    prefill_batch_delay_steps: int = 0
    """Decode-only steps (CUDA-graph replays) the scheduler may run while new requests wait, to
    gather them into one prefill step: a step mixing prefill with decode runs eagerly. Waiting
    requests are admitted once this many steps have held them, or at once when their tokens fill
    the step's budget or nothing is running. 0: admit at once."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, "
                              f"got {self.max_num_batched_tokens}")
        if self.max_running_requests != "auto" and (
                not isinstance(self.max_running_requests, int) or self.max_running_requests < 1):
            raise ConfigError(f"max_running_requests must be 'auto' or an integer >= 1, "
                              f"got {self.max_running_requests!r}")
        if self.max_model_len != "auto" and (
                not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be 'auto' or an integer >= 2, "
                              f"got {self.max_model_len!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prefill_batch_delay_steps < 0:
            raise ConfigError(f"prefill_batch_delay_steps must be >= 0, "
                              f"got {self.prefill_batch_delay_steps}")
        if self.num_continuous_decode_steps < 1:
            raise ConfigError(f"num_continuous_decode_steps must be >= 1, "
                              f"got {self.num_continuous_decode_steps}")
        if self.request_pool < 1 or self.expected_tokens_per_request < 1:
            raise ConfigError("request_pool and expected_tokens_per_request must be >= 1")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; "auto" fields are resolved by `resolve_static`."""

    model: str = "tiny-moe"
    """A checkpoint folder (config.json + safetensors) or a preset name."""
    hf_overrides: str | dict[str, Any] | None = None
    """A JSON object merged over the model's config.json (checkpoint or preset) before it is
    parsed: each key's value replaces the config's whole value (a nested object too), e.g.
    '{"num_hidden_layers": 6}' to serve a model too large for the device at its real widths
    with fewer layers. A dict is accepted from Python (kept as its JSON)."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model folder, or the preset's built-in tokenizer."""
    device: str = "auto"
    """"cuda", "cpu" or "auto" (cuda when available)."""
    dtype: str = "auto"
    """"float32", "bfloat16", "float16" or "auto" (bf16 on GPU, fp32 on CPU)."""
    load_format: str = "auto"
    """"safetensors", "dummy" (random weights) or "auto" (dummy for presets)."""
    moe_backend: str = "auto"
    """"torch" (per-expert loop), "grouped_mm", "triton" (fused MoE), "measured" (per batch
    size the faster of triton and grouped_mm, as the tune measured) or "auto" (measured on
    CUDA, grouped_mm on CPU)."""
    attention_backend: str = "auto"
    """"torch" (reference over the paged KV), "triton" or "auto" (triton on CUDA, torch on
    CPU)."""
    dsa: str = "auto"
    """DeepSeek Sparse Attention models (GLM-5, DeepSeek-V3.2): "auto" (a request whose
    context exceeds index_topk attends to the indexer's top-k positions, a shorter one runs
    dense MLA: the same result) or "dense" (dense MLA for every request, for comparison: no
    indexer runs and no indexer key cache is allocated). No effect on other models."""
    moe_tiles: str = "tuned"
    """The fused MoE's tiles: "tuned" (a committed or cached tuned file for this device and MoE
    shape, tuned at start-up within moe_tune_budget_s when none exists) or "default" (the
    in-code default tiles at every batch size: no tuned file read, no start-up tune; "measured"
    then has no measurements and runs triton)."""
    moe_tune_budget_s: float = 240.0
    """Seconds the start-up tune of the fused MoE may take when no tuned file exists for this
    device and MoE shape (resumable: a later start goes on); 0 = never tune (a committed or
    cached tuned file is still used; moe_tiles=default leaves tuned tiles out)."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs (debugging; decode then pays the host's launch
    cost for every kernel)."""
    cuda_graph_max_batch_size: int | str = "auto"
    """Largest decode batch captured in a CUDA graph; "auto" = max_running_requests (capped by
    the step's token budget), so every decode batch the scheduler can form has a graph."""
    torch_threads: int | str = "auto"
    """Threads torch's CPU ops use in the engine process (torch.set_num_threads); "auto" =
    torch's default, about the usable cores. On CPU it is what moves throughput (against the
    cores other processes use); on a GPU only host-side ops use them."""
    seed: int = 0
    """Seed for dummy weights and for requests without their own seed."""
    collect_expert_load: bool = True
    """Count tokens per expert per MoE layer on the device (read out on demand, no per-step
    sync): /v1/engine and the doctor use it."""
    step_profile_every: int = 32
    """Time attention, MoE and the whole forward of every Nth step with CUDA events (0: off)."""
    async_scheduling: bool | None = None
    """Overlap scheduling: plan and launch step N+1 while the device runs step N (a stop then
    applies one step late and the extra token is discarded). None (auto): on for CUDA unless
    num_continuous_decode_steps > 1."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.hf_overrides is not None:  # validated once; kept as canonical JSON text
            object.__setattr__(self, "hf_overrides", hf_overrides_json(self.hf_overrides))
        _check_choice("device", self.device, ("auto", "cpu", "cuda"))
        _check_choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _check_choice("load_format", self.load_format, ("auto", "safetensors", "dummy"))
        _check_choice("moe_backend", self.moe_backend, ("auto", "torch", "grouped_mm", "triton",
                                                        "measured"))
        _check_choice("attention_backend", self.attention_backend, ("auto", "torch", "triton"))
        _check_choice("dsa", self.dsa, ("auto", "dense"))
        _check_choice("moe_tiles", self.moe_tiles, ("tuned", "default"))
        if self.moe_tune_budget_s < 0:
            raise ConfigError(f"moe_tune_budget_s must be >= 0, got {self.moe_tune_budget_s}")
        if self.cuda_graph_max_batch_size != "auto" and (
                not isinstance(self.cuda_graph_max_batch_size, int)
                or self.cuda_graph_max_batch_size < 1):
            raise ConfigError(f"cuda_graph_max_batch_size must be 'auto' or an integer >= 1, "
                              f"got {self.cuda_graph_max_batch_size!r}")
        if self.torch_threads != "auto" and (not isinstance(self.torch_threads, int)
                                             or isinstance(self.torch_threads, bool)
                                             or self.torch_threads < 1):
            raise ConfigError(f"torch_threads must be 'auto' or an integer >= 1, got "
                              f"{self.torch_threads!r}")
        if self.async_scheduling is True and self.scheduler.num_continuous_decode_steps > 1:
            raise ConfigError("async_scheduling and num_continuous_decode_steps > 1 cannot be "
                              "combined yet: choose one")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices and not (name == "device" and value.startswith("cuda:")):
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def resolve_static(cfg: EngineConfig, model: ModelConfig, is_preset: bool,
                   cuda_available: bool) -> tuple[EngineConfig, dict[str, str]]:
    """Resolve the "auto" values known before loading anything. Returns the new config and the
    reason for each resolved field (keyed by field name)."""
    why: dict[str, str] = {}
    device, dtype, load_format, moe = cfg.device, cfg.dtype, cfg.load_format, cfg.moe_backend
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
        why["device"] = "a CUDA device is available" if cuda_available else "no CUDA device"
    if device.startswith("cuda") and not cuda_available:
        raise ConfigError(f"device={device!r} but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        why["dtype"] = f"default for {device}"
    if load_format == "auto":
        load_format = "dummy" if is_preset else "safetensors"
        why["load_format"] = "a preset has no weights" if is_preset else "checkpoint folder"
    on_cuda = device.startswith("cuda")
    if moe == "auto":
        moe = "measured" if on_cuda else "grouped_mm"
        why["moe_backend"] = (
            "torch._grouped_mm: Triton runs interpreted on CPU" if not on_cuda else
            "measured, with moe_tiles=default: nothing measured, so the fused Triton MoE with "
            "the default tiles at every batch size" if cfg.moe_tiles == "default" else
            "per batch size the faster of the fused Triton MoE and torch._grouped_mm, as the "
            "tune measured (configs/moe/, else tuned at start-up)")
    attn = cfg.attention_backend
    if attn == "auto":
        attn = "triton" if on_cuda else "torch"
        why["attention_backend"] = ("Triton paged attention: CUDA-graph capturable" if on_cuda
                                    else "torch reference: Triton runs interpreted on CPU")
    sched = cfg.scheduler
    overlap = cfg.async_scheduling
    if overlap is None:
        overlap = on_cuda and sched.num_continuous_decode_steps == 1
        why["async_scheduling"] = (
            "CPU: one step at a time" if not on_cuda else
            "num_continuous_decode_steps > 1 runs its steps back to back" if not overlap else
            "overlap the CPU's planning of step N+1 with the GPU's step N")
    if sched.max_model_len == "auto":
        sched = dataclasses.replace(sched, max_model_len=model.max_position_embeddings)
        why["max_model_len"] = "the model's max_position_embeddings"
    elif sched.max_model_len > model.max_position_embeddings:
        raise ConfigError(f"max_model_len {sched.max_model_len} exceeds the model's "
                          f"max_position_embeddings {model.max_position_embeddings}")
    new = dataclasses.replace(cfg, device=device, dtype=dtype, load_format=load_format,
                              moe_backend=moe, attention_backend=attn,
                              async_scheduling=overlap, scheduler=sched)
    return new, why


def resolve_max_running_requests(sched: SchedulerConfig, num_kv_tokens: int) -> tuple[int, str]:
    """DESIGN.md's admission rule. An explicit value is honoured (with a warning in the reason
    when the KV cannot hold it at the expected footprint), never clamped."""
    by_kv = num_kv_tokens // sched.expected_tokens_per_request
    if sched.max_running_requests == "auto":
        value = max(1, min(sched.request_pool, by_kv))
        return value, (f"auto: min(request pool {sched.request_pool}, KV tokens {num_kv_tokens} "
                       f"// {sched.expected_tokens_per_request} expected tokens = {by_kv})")
    value = int(sched.max_running_requests)
    if value > by_kv:
        return value, (f"explicit; WARNING: KV holds {num_kv_tokens} tokens = {by_kv} requests "
                       f"at {sched.expected_tokens_per_request} tokens each, fewer than {value}: "
                       "expect preemptions")
    return value, "explicit"


def parse_hf_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """The `hf_overrides` engine argument as a dict (empty when None); ConfigError naming
    hf_overrides for text that is not JSON or a value that is not a JSON object."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"hf_overrides is not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"hf_overrides must be a JSON object of config.json fields, e.g. "
                          f"'{{\"num_hidden_layers\": 6}}'; got {value!r}")
    return value


def hf_overrides_json(value: str | dict[str, Any]) -> str:
    """`hf_overrides` as canonical JSON text (sorted keys), validated."""
    overrides = parse_hf_overrides(value)
    try:
        return json.dumps(overrides, sort_keys=True)
    except (TypeError, ValueError) as e:  # a dict from Python holding a non-JSON value
        raise ConfigError(f"hf_overrides must hold JSON values only: {e}") from None


def read_model_hf_config(model: str) -> tuple[dict[str, Any], bool]:
    """The raw config.json dict of a checkpoint folder or a preset. Returns (dict, is_preset)."""
    from moeserve.presets import is_preset, load_preset

    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model folder {model!r} has no config.json")
        return read_json_config(path), False
    if is_preset(model):
        return load_preset(model), True
    raise ConfigError(f"model {model!r} is neither a checkpoint folder nor a preset "
                      "(see `moeserve presets`)")


def load_model_config(model: str, hf_overrides: str | dict[str, Any] | None = None
                      ) -> tuple[ModelConfig, bool]:
    """A checkpoint folder's config.json, or a preset, with `hf_overrides` merged over it
    before parsing. Returns (config, is_preset). The engine and the API processes both build
    their ModelConfig here, so they see the same overridden config."""
    overrides = parse_hf_overrides(hf_overrides)
    hf, preset = read_model_hf_config(model)
    if not overrides:
        return ModelConfig.from_hf(hf), preset
    try:
        return ModelConfig.from_hf({**hf, **overrides}), preset
    except ConfigError as e:
        raise ConfigError(f"{e} (with hf_overrides {json.dumps(overrides, sort_keys=True)} "
                          "applied)") from None


