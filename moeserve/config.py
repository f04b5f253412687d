"""Engine configuration: frozen dataclasses, validated on construction.

The model's shape (`ModelConfig`, from a config.json) is in moeserve/model_config.py, imported
here for `load_model_config` and `resolve_static`. These configs hold the user's knobs; a knob
may be "auto", and `resolve_static` turns those into values with a reason for each (the
capacity report prints the reasons). Figures found at run time (KV blocks, the admission cap)
are returned by the runner and `resolve_max_running_requests`, never written back into a
config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from moeserve.kernels.attention.limits import paged_triton_unfit
from moeserve.model_config import (  # ConfigError: the engine configs raise it too
    ConfigError,
    ModelConfig,
    read_json_config,
)
from moeserve.quant.spec import flag_format, parse

# kv_cache_dtype's names -> the cache's element type (None: the model's dtype); torch-free
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


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
    kv_cache_dtype: str = "auto"
    """KV cache element type: auto (the model's dtype) or fp8 (alias fp8_e4m3: float8 e4m3,
    half of bf16's bytes, so twice the tokens; values stored unscaled, clamped to +-448, as
    vLLM does for a checkpoint without k/v scales): GQA's K/V, or MLA's latent rows (DSA's
    indexer keys stay in the model's dtype)."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = (" (fp8_e5m2 is not implemented; fp8_e4m3 is)"
                    if self.kv_cache_dtype == "fp8_e5m2" else "")
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}{hint}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is the null block), "
                              f"got {self.num_blocks}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """One model over several devices (docs/parallel.md): tensor and expert parallelism."""

    tensor_parallel_size: int = 1
    """World size W: ranks over all nodes (--tp); attention and dense layers split W ways."""
    enable_expert_parallel: bool = False
    """Split the routed experts across the ranks instead of each expert's width (EP = W
    unless expert_parallel_size says otherwise)."""
    expert_parallel_size: int | None = None
    """EP of a MoE split MoE-TP x EP = W (e.g. 2 of W = 4: MoE TP 2 x EP 2); None: W with
    enable_expert_parallel, else 1."""
    nnodes: int = 1
    """Nodes the W ranks span (W / nnodes on each)."""
    node_rank: int = 0
    """This node's index; node 0 runs the engine core and API, the others --headless."""
    master_addr: str = "127.0.0.1"
    """Address of node 0's rendezvous (torch.distributed's TCP store)."""
    master_port: int | None = None
    """Port of the rendezvous; None picks a free one (one node only)."""
    step_timeout_s: float = 300.0
    """Deadline of one engine step over the ranks: a rank that misses it is named and the
    engine ends (collectives in CUDA graphs have no timeout of their own)."""
    headless: bool = False
    """Run this node's ranks as workers only (no API server, no engine core): nodes >= 1."""
    distributed_at_one_rank: bool = False
    """At tensor_parallel_size 1, run through torch.distributed anyway (a world of one: the
    sharded layers, their collectives and the control group), to measure what that path
    costs on one GPU."""

    def __post_init__(self) -> None:
        w, ep = self.tensor_parallel_size, self.expert_parallel_size
        if w < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {w}")
        if self.nnodes < 1 or w % self.nnodes:
            raise ConfigError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size ({w}): "
                              "each node runs W / nnodes ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} is not in [0, nnodes {self.nnodes})")
        if ep is not None and (ep < 1 or w % ep):
            raise ConfigError(f"expert_parallel_size {ep} must divide tensor_parallel_size {w} "
                              "(MoE TP x EP = W)")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("several nodes need --master-port (and --master-addr): every "
                              "node must name the same rendezvous")
        if self.step_timeout_s <= 0:
            raise ConfigError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.headless and self.node_rank == 0:
            raise ConfigError("node 0 runs the engine core: --headless is for node_rank >= 1 "
                              "of --nnodes > 1")

    @property
    def ep_size(self) -> int:
        if self.expert_parallel_size is not None:
            return self.expert_parallel_size
        return self.tensor_parallel_size if self.enable_expert_parallel else 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


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
    generation_config: str = "auto"
    """The model's sampling defaults for what a request leaves out (the API server, and
    `LLM.generate` without params): "auto" = the model folder's generation_config.json
    (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM and SGLang
    do; "none" = moeserve's neutral ones ("vllm" accepted); or a folder holding a
    generation_config.json (hf_config/generation.py)."""
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
    mla_prefill: str = "auto"
    """Multi-head latent attention models (DeepSeek, Kimi, GLM-4.7-Flash, GLM-5): how rows
    with several queries (prefill chunks, prefix hits) attend. "mha": the context's latents
    up-projected through kv_b_proj, then multi-head attention; "absorbed": over the latent
    cache as the decode rows do (W_UK folded into the queries: no up-projection, more FLOPs a
    cached token); "auto": rows whose context is at most layers/mla.py's
    AUTO_ABSORBED_MAX_CONTEXT tokens absorbed (GLUON_ABSORBED_MAX_CONTEXT's where the absorbed
    prefill runs in Gluon, sm90), longer ones up-projected, and fresh prompts (no cached
    prefix) of layers/mla.py's FRESH_VARLEN_MIN_TOKENS or more up-projected in one
    variable-length flash launch (the faster form of each, as measured on the H200). The same
    result. No effect on other models."""
    mla_decode: str = "auto"
    """Multi-head latent attention models, Triton attention: how decode rows attend. "split":
    a program a row (and context partition, for long contexts); "flat": a program an SM over
    the step's flattened row tiles, rows cut between programs merged after
    (kernels/attention/mla/decode_flat_triton.py); "gluon": the split decode on Hopper's wgmma
    (decode_gluon.py; an sm90 GPU, bf16 / fp16 cache); "auto": gluon where it takes the
    inputs, else flat for steps of at most 256 decode rows at up to 32 heads, split otherwise
    (the faster of each, as measured on the H200). The same result to rounding. Needs
    attention_backend "triton" (or "auto" on CUDA) unless "auto"."""
    quantization: str | None = None
    """fp8, nvfp4 or int4 (vLLM's modelopt_fp4 and compressed-tensors accepted). With a quantized
    checkpoint: its format, checked (a value the checkpoint contradicts is an error); None:
    whatever it declares. With an unquantized checkpoint or load_format dummy: the layout its
    weights are quantized into as they load (every linear projection, by the format's rule; the
    embedding, LM head, routers, norms and MLA's kv_b_proj stay in `dtype`)."""
    dequantize_linears: bool = False
    """A quantized model's projections outside the routed experts (attention, the DSA indexer,
    dense MLPs, shared experts) held in `dtype`, dequantized once as they load (exact for nvfp4
    and int4; fp8's W8A8 becomes a `dtype` GEMM), the routed experts staying quantized: more
    weight memory (their bytes x 2 / 0.5625 for nvfp4), and cuBLAS's speed for those
    projections (on an H100 the W4A16 linear kernels took 1.0-3x bf16's time at 64-1,024
    tokens, benchmarks/results/gpu_6b1031a/call3). No effect on an unquantized model."""
    moe_weight_layout: str = "auto"
    """How NVFP4 / INT4 routed experts' packed weights lie in memory: "rows" (row by row, as
    the checkpoint's), "micro" (16-row x 64-byte tiles, each K step of the fused MoE a run of
    whole kilobytes: kernels/moe/quant/micro_tiles.py; CUDA only) or "auto" (micro on CUDA
    where the experts' dims are multiples of 128, rows otherwise). The same result; on an
    H100 GLM-5's experts took 13% (NVFP4) / 9% (INT4) less time micro-tiled at 64 tokens. No
    effect on bf16 or FP8 experts with "auto"; "micro" there is an error."""
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
    fold_shared_experts: bool = False
    """Run a MoE block's shared experts inside the routed experts' launch: their weights
    appended to the routed stack as always-selected experts (one per routed width of the
    shared width, weight 1), so the block is one MoE op with no separate MLP and no extra
    part. bf16 experts without expert parallelism only (the capacity report says why not
    otherwise). Off: on the H200, W1 on glm-4.7-flash moved -0.4 / +1.3 / +0.9 points at 256 /
    512 / 1,024 streams, within one run's noise (benchmarks/results/gpu_70a3760/); a knob of
    `moeserve tune`'s space."""
    mixed_cuda_graphs: bool = False
    """Mixed (prompt + decode) steps replay piecewise CUDA graphs: one graph per piece between
    two attentions, at token-count buckets up to the step's token budget, each attention run
    eagerly between them (runner/mixed_graphs.py). Off: on the H200, W1 on qwen3-30b-a3b at
    99.0-99.8% of the defaults' medians at 256-2,048 streams, three alternated repetitions
    (benchmarks/results/gpu_ed8f6d2/), and glm-4.7-flash at 1,024 one run 50.5% against 51.5%
    (gpu_7c427c9/)."""
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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

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
        _check_choice("mla_prefill", self.mla_prefill, ("auto", "mha", "absorbed"))
        _check_choice("mla_decode", self.mla_decode, ("auto", "split", "flat", "gluon"))
        _check_choice("moe_tiles", self.moe_tiles, ("tuned", "default"))
        _check_choice("moe_weight_layout", self.moe_weight_layout, ("auto", "rows", "micro"))
        if self.quantization is not None:
            flag_format(self.quantization)
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


def _check_quantization(wanted: str, model: ModelConfig, load_format: str) -> None:
    have = model.quantization.format if model.quantization is not None else None
    if load_format == "dummy" or have is None:
        return  # random or unquantized weights are quantized into the wanted layout
    if have != wanted:
        raise ConfigError(f"--quantization {wanted} contradicts the checkpoint, which holds "
                          f"{have} weights")


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
    unfit = None if model.mla is not None else paged_triton_unfit(model.head_dim)
    if attn == "auto":
        attn = "triton" if on_cuda and unfit is None else "torch"
        why["attention_backend"] = (
            "torch reference: Triton runs interpreted on CPU" if not on_cuda else
            f"torch reference: the Triton paged attention does not take {unfit}" if unfit else
            "Triton paged attention: CUDA-graph capturable")
    elif attn == "triton" and unfit is not None:
        raise ConfigError(f"attention_backend='triton': the Triton paged attention does not "
                          f"take this model's {unfit}; use attention_backend='torch' or 'auto'")
    if model.mla is not None and cfg.mla_decode != "auto" and attn != "triton":
        raise ConfigError(f"mla_decode={cfg.mla_decode!r} is a form of the Triton MLA decode; "
                          f"attention_backend resolves to {attn!r} here (the torch reference "
                          f"has one form): use attention_backend='triton' or mla_decode='auto'")
    if model.mla is not None and cfg.mla_decode == "gluon" and not on_cuda:
        raise ConfigError("mla_decode='gluon' is the MLA decode in Gluon on Hopper's wgmma "
                          "(an sm90 GPU, bf16 or fp16); this engine's device is not CUDA")
    sched = cfg.scheduler
    overlap = cfg.async_scheduling
    if overlap is None:
        overlap = on_cuda and sched.num_continuous_decode_steps == 1
        why["async_scheduling"] = (
            "CPU: one step at a time" if not on_cuda else
            "num_continuous_decode_steps > 1 runs its steps back to back" if not overlap else
            "overlap the CPU's planning of step N+1 with the GPU's step N")
    if cfg.quantization is not None:
        _check_quantization(flag_format(cfg.quantization), model, load_format)
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
        hf = read_json_config(path)
        modelopt = os.path.join(model, "hf_quant_config.json")
        if os.path.isfile(modelopt):  # ModelOpt's NVFP4 may be declared only there
            extra = read_json_config(modelopt)
            parse(hf, extra)  # checked against config.json's own quantization_config
            quant = extra.get("quantization")
            if hf.get("quantization_config") is None and isinstance(quant, dict):
                hf = hf | {"quantization_config": {"quant_method": "modelopt", **quant}}
        return hf, False
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


