"""The KV cache: its memory plan and its tensors.

DESIGN.md's memory plan, in order: (1) weights are loaded, (2) one forward at the largest token
budget is profiled for its activation peak (`profile_step`: that chunk at the end of the longest
context, where the attention's transients are largest: DSA's indexer scores every earlier
position, the up-projected MLA prefill materialises the context's keys and values), (3) a
reserve is kept for CUDA graphs, (4) the KV cache gets the rest of `total x mem_fraction`. On
CPU the KV cache gets a fixed byte budget. `MemoryPlan` keeps every term so the capacity report
can print them.

Layout: one tensor per layer, [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] (GQA;
or MLA's latent [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (one shared row per
token: 576 values for DeepSeek-V3), in the model's dtype or float8 e4m3 (kv_cache_dtype="fp8",
whose bytes the plan counts); a "full" DSA layer (GLM-5, DeepSeek-V3.2) has a second tensor
beside its latent, the indexer's keys [num_blocks, block_size, index_head_dim] (always the
model's dtype: the indexer kernels read them as they are), paged
alike (a DsaLayerCache; a "shared" DSA layer has the latent only). Block 0 is the null block
(padding points at it; the scheduler never hands it out). Every term is in bytes_per_block, so
the memory plan and the capacity report count the indexer keys; `indexer_cache` False (the
engine's dsa="dense") leaves them out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moeserve.config import KV_CACHE_DTYPES, CacheConfig, ConfigError
from moeserve.layers.dsa import DsaLayerCache
from moeserve.model_config import ModelConfig
from moeserve.types import SamplingParams, SchedulerOutput

LayerCache = torch.Tensor | DsaLayerCache
FP8_DTYPES = (torch.float8_e4m3fn,)  # kv_cache_dtype="fp8"

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    device: str
    total_bytes: int  # device memory (GPU) or 0 (CPU)
    budget_bytes: int  # total x mem_fraction (GPU) or the CPU KV budget
    weight_bytes: int
    activation_peak_bytes: int  # profiled forward + sampling at the largest batch
    graph_reserve_bytes: int  # CUDA graphs (0 while decode runs eager)
    kv_bytes: int
    bytes_per_block: int
    num_blocks: int
    block_size: int
    rule: str  # how num_blocks was found, in words

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the cache holds, null block excluded."""
        return (self.num_blocks - 1) * self.block_size

    def to_dict(self) -> dict:
        return asdict(self) | {"num_kv_tokens": self.num_kv_tokens}


def profile_step(num_tokens: int, context_len: int, block_size: int) -> tuple[SchedulerOutput,
                                                                             int]:
    """The step the activation peak is profiled on, and the blocks its pool needs: one row whose
    last `num_tokens` prompt tokens are scheduled at the end of a `context_len`-token context
    (the rest counted as computed; their cache holds whatever the pool held). A step's
    transients grow with its rows' contexts as well as its tokens: on the H200 GLM-4.7-Flash's
    peak was 10.98 GiB this way against 5.2-6.9 GiB at an empty context, while its
    up-projected MLA prefill at 202,752 tokens of context built a [Q, S] causal mask and held
    the whole context up-projected; without them (paged.MAX_MASK_ELEMENTS, mla/up_projected's
    chunks) 6.89 GiB and 1,232,544 KV tokens instead of 1,151,488 (gpu_7c427c9/call1). The
    runner profiles under mla/up_projected.memory_probe (a row's first two prefix chunks): the
    same peak without attending the whole context in every layer. Qwen3's plan is unchanged
    (667,360 KV tokens). Several rows at long contexts stay within it
    where the attention is a Triton kernel, DSA's indexer (it scores in chunks of bounded bytes) or
    MLA's up-projected prefill (its rows in paged.bounded_groups); the other torch references,
    the CPU's paths, pad a step's prefill rows into one batch."""
    if not 1 <= num_tokens <= context_len:
        raise ValueError(f"profile_step: num_tokens {num_tokens} must be in 1..context_len "
                         f"({context_len})")
    num_blocks = -(-context_len // block_size) + 1  # and the null block
    step = SchedulerOutput(
        req_ids=["profile"], num_scheduled_tokens=[num_tokens],
        num_computed_tokens=[context_len - num_tokens], token_ids=[0] * num_tokens,
        block_tables=[list(range(1, num_blocks))], sample=[True],
        sampling_params=[SamplingParams()], sample_seeds=[0], num_output_tokens=[0])
    return step, num_blocks


def cache_dtype(cfg: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The attention cache's element type: the model's, or float8 e4m3 (kv_cache_dtype
    "fp8"). DSA's indexer keys always take the model's."""
    name = KV_CACHE_DTYPES[cfg.kv_cache_dtype]
    return getattr(torch, name) if name else model_dtype


def bytes_per_token(model: ModelConfig, dtype: torch.dtype, indexer_cache: bool = True,
                    index_dtype: torch.dtype | None = None) -> int:
    """One token's bytes over every layer: the attention cache in `dtype`, and (a DSA model,
    indexer_cache) the indexer keys in `index_dtype` (default: dtype; the model's when the
    attention cache is float8)."""
    elem = dtype.itemsize
    index = model.cache_elems_per_token(indexer_cache) - model.cache_elems_per_token(False)
    return (model.cache_elems_per_token(False) * elem
            + index * (index_dtype or dtype).itemsize)


def bytes_per_block(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                    indexer_cache: bool = True, index_dtype: torch.dtype | None = None) -> int:
    return cache.block_size * bytes_per_token(model, dtype, indexer_cache, index_dtype)


def kv_layout(model: ModelConfig, dtype: torch.dtype, indexer_cache: bool = True,
              index_dtype: torch.dtype | None = None) -> str:
    """What one token costs in the cache, in words (the capacity report's line)."""
    elem = dtype.itemsize
    per_layer = model.kv_bytes_per_token_per_layer_elem * elem
    what = (f"MLA latent {model.mla.kv_lora_rank} + rope {model.mla.qk_rope_head_dim}"
            if model.mla is not None else
            f"K, V x {model.num_kv_heads} heads x {model.head_dim}")
    if dtype in FP8_DTYPES:  # the model's own dtype goes without saying
        what += f", {str(dtype).removeprefix('torch.')}"
    line = f"{per_layer:,} B a layer ({what}) x {model.num_layers} layers"
    if model.dsa is not None:
        if indexer_cache:
            index = model.dsa.index_head_dim * (index_dtype or dtype).itemsize
            line += (f" + DSA indexer key {index:,} B ({model.dsa.index_head_dim}) x "
                     f"{model.index_cache_layers} full layers")
        else:
            line += " (dsa=dense: no DSA indexer keys)"
    return f"{line} = {bytes_per_token(model, dtype, indexer_cache, index_dtype):,} B"


def plan_memory(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                weight_bytes: int, activation_peak_bytes: int,
                graph_reserve_bytes: int = 0, indexer_cache: bool = True,
                index_dtype: torch.dtype | None = None) -> MemoryPlan:
    """Size the KV cache. Raises ConfigError naming the knob when nothing is left for it."""
    per_block = bytes_per_block(model, cache, dtype, indexer_cache, index_dtype)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * cache.mem_fraction)
        kv_bytes = budget - weight_bytes - activation_peak_bytes - graph_reserve_bytes
        rule = (f"total {total / GiB:.1f} GiB x mem_fraction {cache.mem_fraction} - weights "
                f"- activation peak - graph reserve")
    else:
        total, budget = 0, cache.cpu_kv_cache_bytes
        kv_bytes = budget
        rule = f"CPU: cpu_kv_cache_bytes {budget / GiB:.2f} GiB"
    num_blocks = kv_bytes // per_block
    if cache.num_blocks is not None:
        num_blocks, kv_bytes = cache.num_blocks, cache.num_blocks * per_block
        rule = f"num_blocks={cache.num_blocks} set explicitly"
    if num_blocks < 2:
        raise ConfigError(
            f"no memory left for the KV cache ({kv_bytes / GiB:.2f} GiB after weights "
            f"{weight_bytes / GiB:.2f} GiB and activations {activation_peak_bytes / GiB:.2f} GiB): "
            "raise mem_fraction, lower max_num_batched_tokens, or use a smaller model")
    return MemoryPlan(device=str(device), total_bytes=total, budget_bytes=budget,
                      weight_bytes=weight_bytes, activation_peak_bytes=activation_peak_bytes,
                      graph_reserve_bytes=graph_reserve_bytes, kv_bytes=num_blocks * per_block,
                      bytes_per_block=per_block, num_blocks=num_blocks,
                      block_size=cache.block_size, rule=rule)


def allocate_kv_caches(model: ModelConfig, plan: MemoryPlan, dtype: torch.dtype,
                       device: torch.device, indexer_cache: bool = True,
                       index_dtype: torch.dtype | None = None) -> list[LayerCache]:
    """One zeroed cache per layer in `dtype`: [2, num_blocks, block_size, num_kv_heads,
    head_dim], or the MLA latent [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim],
    with (a full DSA layer, indexer_cache) the indexer keys [num_blocks, block_size,
    index_head_dim] beside it in `index_dtype` (default: dtype)."""
    shape: tuple[int, ...] = (2, plan.num_blocks, plan.block_size, model.num_kv_heads,
                              model.head_dim)
    if model.mla is not None:
        shape = (plan.num_blocks, plan.block_size, model.mla.latent_dim)
    caches: list[LayerCache] = []
    for i in range(model.num_layers):
        latent = torch.zeros(shape, dtype=dtype, device=device)
        if indexer_cache and model.dsa is not None and model.dsa.is_full(i):
            keys = torch.zeros(plan.num_blocks, plan.block_size, model.dsa.index_head_dim,
                               dtype=index_dtype or dtype, device=device)
            caches.append(DsaLayerCache(latent, keys))
        else:
            caches.append(latent)
    return caches


def num_cache_blocks(caches: list[LayerCache]) -> int:
    """The blocks of allocated caches (0 when none)."""
    if not caches:
        return 0
    first = caches[0]
    tensor = first.latent if isinstance(first, DsaLayerCache) else first
    return tensor.shape[1] if tensor.dim() == 5 else tensor.shape[0]  # GQA [2, NB, ...]
