"""Self-attention over the paged KV cache (GQA, optional Qwen3 q/k norm, RoPE).

One forward, for the T tokens of a step (prefill chunks and decodes mixed):

    hidden [T, hidden] --qkv_proj--> q [T, H, D], k [T, KVH, D], v [T, KVH, D]
      -> q_norm / k_norm (per head, over D; Qwen3 only) -> RoPE at positions
      -> write_kv(k, v) into self.kv_cache at meta.slot_mapping
      -> attention_backend(q, kv_cache, meta, scale) [T, H, D] --o_proj--> [T, hidden]

On CUDA the three middle steps are one Triton launch (kernels/attention/qk_rope_kv_triton.py: it
reads each token's qkv row once and writes q [T, H, D] and the token's K/V slot; five launches fewer
per layer and step); elsewhere the torch ops run one by one (bit for bit HF's).

`self.kv_cache` is [2, num_blocks, block_size, KVH, D], bound by the runner
(CausalLM.bind_kv_caches) before the first forward. NOTE: it must stay the same tensor object
across steps, because CUDA graphs capture its address; rebind only outside captured graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.paged import write_kv
from moeserve.kernels.attention.qk_rope_kv_triton import qk_rope_kv_triton, split_qkv
from moeserve.layers.linear import WeightFactory, linear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.params import empty_param
from moeserve.layers.rope import RotaryEmbedding
from moeserve.model_config import ModelConfig

# fn(q [T, H, D], kv_cache [2, NB, BS, KVH, D], meta, scale) -> [T, H, D]
AttentionBackend = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]



class Attention(nn.Module):
    def __init__(self, layer_idx: int, config: ModelConfig, attention_backend: AttentionBackend,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 weights: WeightFactory | None = None) -> None:
        """weights: declares the projections under the model's quantization plan."""
        super().__init__()
        weights = weights or WeightFactory()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = d = config.head_dim
        self.scale = d ** -0.5
        self.backend = attention_backend
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d
        self.qkv_proj = weights.linear("qkv_proj", qkv_rows, config.hidden_size, dtype=dtype,
                                       device=device)
        self.qkv_bias = (empty_param(qkv_rows, dtype=dtype, device=device) if config.qkv_bias
                         else None)  # GLM-4.5's q/k/v biases
        self.o_proj = weights.linear("o_proj", config.hidden_size, self.num_heads * d,
                                     dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(d, config.max_position_embeddings, config.rope_theta, device,
                                      rotary_dim=config.rotary_dim, rope=config.rope)
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, KVH, D]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q = self.pre_attention(positions, hidden, meta.slot_mapping)
        return self.post_attention(self.attention_core(q, meta))  # [T, hidden]

    # the forward in three parts: piecewise CUDA graphs (runner/mixed_graphs.py) capture the
    # first and the last, whose shapes depend only on the token count, and run the core eagerly

    @property
    def attention_out_dim(self) -> int:
        """Width of the core's output per token (the output projection's input)."""
        return self.num_heads * self.head_dim

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
        """hidden [T, h] -> q [T, H, D], with this step's K/V written at slot_mapping [T]."""
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound (bind_kv_caches)")
        qkv = linear(hidden, self.qkv_proj, self.qkv_bias)  # [T, (H + 2 * KVH) * D]
        return self._qk_rope_kv(positions, qkv, slot_mapping, fused=qkv.is_cuda)

    def attention_core(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D] over the paged cache -> [T, H, D]."""
        return self.backend(q, self.kv_cache, meta, self.scale)

    def post_attention(self, out: torch.Tensor) -> torch.Tensor:
        """The core's output [T, H, D] (or [T, H * D]) -> [T, hidden]."""
        return linear(out.reshape(out.shape[0], -1), self.o_proj)

    def _qk_rope_kv(self, positions: torch.Tensor, qkv: torch.Tensor,
                    slot_mapping: torch.Tensor, fused: bool) -> torch.Tensor:
        """q/k norm, RoPE and the K/V write of qkv [T, (H + 2 * KVH) * D] -> q [T, H, D].
        fused: one Triton launch (CUDA, or CPU under Triton's interpreter in tests)."""
        if fused:
            weights = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                       if self.q_norm is not None else (None, None, 0.0))
            return qk_rope_kv_triton(qkv, positions, self.rotary.cos, self.rotary.sin,
                                     self.kv_cache, slot_mapping, self.num_heads,
                                     self.num_kv_heads, *weights)
        q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)  # views
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        write_kv(k, v, self.kv_cache, slot_mapping)
        return q
