"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight, GLM-4.7-Flash) over the
paged latent cache.

One forward, for the T tokens of a step (H heads; L = kv_lora_rank, R = qk_rope_head_dim):

    hidden [T, h] --in_proj--> [q part | c_kv (L) | k_rope (R)]     (one GEMM: q_a_proj or
                                                                     q_proj, and kv_a_proj)
      q part -> (q_a_layernorm -> q_b_proj when q_lora_rank) -> q [T, H, nope + R]
      c_kv -> kv_a_layernorm;  q_rope, k_rope -> RoPE (interleaved pairs or halves; YaRN)
      latent_cache[slot] = [c_kv | k_rope]       (kernels/attention/mla/reference.py)
      (on CUDA the norm, both RoPEs and the write are one launch, reading each token's kv_a
      row once: kernels/attention/mla/rope_cache_triton.py; elsewhere the torch ops one by one)
      decode rows, absorbed:  q_lat = [q_nope @ W_UK[h] | q_rope] -> mla_backend -> [T, H, L]
                              -> @ W_UV[h]^T -> [T, H, v]
      prefill rows, up-projected ("mha"): the context's latents through kv_b_proj to
                              per-head K/V (mla_prefill_ref) -> [T, H, v]; or absorbed, as
                              decode (`prefill_form`: "auto" absorbs the short contexts)
      -> o_proj -> [T, h]

W_UK [H, nope, L] and W_UV [H, v, L] are views of kv_b_proj ([H * (nope + v), L], HF's layout),
made once at construction: the loader and the dummy init fill kv_b_proj in place. A step whose
rows are all decodes (every CUDA-graph replay) builds no host tensors.

`self.kv_cache` is the latent cache [num_blocks, block_size, L + R], bound by the runner; it must
stay the same tensor object across steps (CUDA graphs capture its address).

DeepSeek Sparse Attention (layers/dsa.py) subclasses this layer: `extra_in_rows` appends its
indexer key projection to in_proj, and `_attend` (the attention of the step's rows, given the
projections) is where it picks sparse or dense rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from moeserve import envs
from moeserve.kernels.attention.metadata import AttentionMetadata, select_rows
from moeserve.kernels.attention.mla import decode_gluon
from moeserve.kernels.attention.mla.absorbed_triton import DECODE_FORMS, mla_attention_triton
from moeserve.kernels.attention.mla.reference import mla_prefill_ref, write_latent
from moeserve.kernels.attention.mla.rope_cache_triton import (
    mla_rope_cache_triton,
    rotate_pairs,
)
from moeserve.kernels.attention.mla.up_projected import attend_fresh_rows
from moeserve.layers.linear import WeightFactory, linear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.params import empty_param
from moeserve.layers.rope_scaling import inv_freq_and_factor, softmax_scale
from moeserve.model_config import ModelConfig

# fn(q_lat [T, H, L + R], latent_cache [NB, BS, L + R], meta, scale, L) -> [T, H, L]
MlaBackend = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, int], torch.Tensor]
# how rows with several queries attend (MLAttention.prefill_form; the engine's mla_prefill):
# "auto" (rows whose context is at most `auto_max_context` tokens absorbed, longer ones
# up-projected), "mha" (every such row up-projected) or "absorbed" (every row absorbed)
PREFILL_FORMS = ("auto", "mha", "absorbed")
# "auto"'s default: a row whose context (its cached tokens and this step's) is at most this
# long attends absorbed. By FLOPs the up-projected form wins on a fresh prompt of any length
# (2 x (nope + R + v) a query-key pair against 2 x (2L + R); the up-projection of its keys
# matches the absorption of its queries) and the absorbed form on a short chunk after a long
# prefix; but the MHA form's gathers, padding and scatters cost per token. On the H200 with
# the absorbed prefill at (64, 32, 8, 3) (benchmarks/results/gpu_b790193/call3_*/,
# kernels_mla_prefill): every case of a context up to 512 ran faster absorbed (W1's mixed step
# 2.2x / 1.6x at GLM-4.7-Flash / DeepSeek-V3, 512-token prompts 1.9x / 1.14x); at 2k-8k the
# up-projected form won at 128 heads and mostly at 20. W1 (128-token prompts) ran 11.6% faster
# absorbed (glm-4.7-flash at 1,024: 18,078 against 16,203 output tok/s, call1_b790193).
AUTO_ABSORBED_MAX_CONTEXT = 512
# a prefill row's form in a step: the absorbed kernels, the padded up-projected reference
# (mla_prefill_ref), or fresh prompts' variable-length launch (`fresh_varlen`)
ABSORBED, MHA, FRESH = 0, 1, 2
# ... and where the absorbed prefill runs in Gluon (mla/prefill_gluon.py: sm90, a bf16 / fp16
# cache), 1.07-1.9x faster than the Triton prefill at every case, the crossover moves out
# with the FLOPs a query-key pair costs absorbed over up-projected, (2L + R) / (nope + R + v)
# (benchmarks/results/gpu_5bd5ebf/call6-7, kernels_mla_prefill --gluon): at GLM's 2.1 (nope
# 192, v 256) absorbed ran 0.13-0.94x mha's time at every context up to 8,192; at
# DeepSeek-V3's 3.4 (nope 128, v 128) 0.53-0.68x up to 512 tokens and 2,304 after a prefix,
# 1.01x for a fresh 2,048, 1.09-1.91x at 4,096-8,192. Re-measured with the up-projected rows
# in context chunks and fresh prompts of FRESH_VARLEN_MIN_TOKENS and more in their own launch
# (gpu_7c427c9/call1), the rows left to this choice (chunks after a prefix) ran absorbed at
# 0.32 / 0.64 / 0.92x mha's time at DeepSeek-V3's contexts of 2,304 / 4,096 / 8,192, and at
# 0.08 / 0.21 / 0.71x at GLM's; at GLM's 32k-202k also 0.75-0.77x (with a third of the peak
# memory), but "auto" stays up-projected there: the memory plan profiles the token budget at
# the end of a max_model_len context, which the absorbed form attends whole in every layer
# (mla/up_projected.memory_probe shortens only the up-projected form's). One limit for both
# shapes, then (it was by the pair-FLOP ratio until 670f09a).
GLUON_ABSORBED_MAX_CONTEXT = 8192
# ... and, under "auto", a fresh prompt (no cached prefix) of at least this many tokens goes
# up-projected in one variable-length FlashAttention-2 launch (`fresh_varlen`): on the H200
# (benchmarks/results/gpu_7c427c9/call1, kernels_mla_prefill --gluon --fresh-varlen) against
# the absorbed Gluon prefill it ran 0.91x / 0.84x the time of 16 prompts of 512 at
# GLM-4.7-Flash / DeepSeek-V3, 0.74x / 0.62x at 4 x 2,048, 0.64x / 0.49x at 1 x 8,192; shorter
# prompts ran slower (64 x 128: 1.08x / 1.04x) and W1's mixed step, split into two launches,
# 1.85x / 1.05x. The launch holds the fresh rows' up-projected keys and values, at most the
# step's token budget of them: no more than the profiled step's own span (kv_cache.profile_step).
FRESH_VARLEN_MIN_TOKENS = 512
# ... but beside rows that attend absorbed (decodes, chunks after a prefix) the step splits into
# two launches, and there the fresh rows' own launch pays only from more work: heads x the sum
# of their squared lengths (the causal pairs' count, x 2), at least this. On the H200 beside
# 1,024 decode rows (gpu_4705423/call1, kernels_mla_prefill's mixed_* cases) it ran 1.53x /
# 1.04x the time of one absorbed launch at GLM-4.7-Flash's 4 x 512 / 1 x 2,048 (20 heads: 2^24.3
# / 2^26.3) and 0.92x / 0.71x at DeepSeek-V3's (128 heads: 2^27 / 2^29): the ratio falls with
# this product across both shapes, and crosses 1 between 2^26.3 and 2^27.
FRESH_MIN_WORK_BESIDE_ABSORBED = 1 << 27
# pre_attention writes the rotated q_rope straight into the absorbed attention's query buffer
# [T, H, L + R] (its last R columns; the bmm writes the first L) when T x H is at most this, so
# `_absorbed` needs no copy of it (0.25 ms of glm-4.7-flash's 1,024-row decode step on the
# H200, 1.4 ms of W1's mixed step: gpu_4705423/call1). Above it (DeepSeek-V3's 128 heads past
# 2,048 tokens, GLM's 20 past 13,107) a step is mostly long prompts that attend up-projected,
# where that buffer would be held for nothing: q_rope is its own tensor, as before. At the
# limit the buffer is 302 MB in bf16, what `_absorbed` allocates for those rows anyway.
LATENT_QUERY_MAX_ROWS = 1 << 18

@functools.lru_cache(maxsize=8)
def _pair_table(config_key: tuple, dim: int, max_position: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, dim / 2] fp32 of each rotary pair (the per-pair angle), times YaRN's
    factor; shared by the layers."""
    rope = dict(config_key)["rope"]
    inv_freq, factor = inv_freq_and_factor(rope, dim)
    freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
    return (freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device)


class Projected(NamedTuple):
    """What a step's forward computed before the attention, for `_attend` overrides."""

    hidden: torch.Tensor  # [T, h] the layer's input
    proj: torch.Tensor  # [T, in_proj rows]: [q part | c_kv | k_rope | extra rows]
    q_resid: torch.Tensor  # [T, q_lora_rank] the normed q_a output (or the q part)
    cos: torch.Tensor  # [T, R / 2] at each token's position
    sin: torch.Tensor
    # [T, H, L + R]: the absorbed query, its last R columns q_rope already (q_rope is a view
    # of them) and the first L for `_absorbed` to fill; None: q_rope is its own tensor
    q_lat: torch.Tensor | None = None


class MlaState(NamedTuple):
    """pre_attention's output: what the core reads."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_rope: torch.Tensor  # [T, H, R], rotated
    proj: Projected


class MLAttention(nn.Module):
    def __init__(self, layer_idx: int, config: ModelConfig, mla_backend: MlaBackend,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, extra_in_rows: int = 0,
                 weights: WeightFactory | None = None) -> None:
        """weights: declares the projections under the model's quantization plan (kv_b_proj
        stays in the engine's dtype: W_UK and W_UV are views of it)."""
        super().__init__()
        weights = weights or WeightFactory()
        m = config.mla
        assert m is not None
        self.layer_idx, self.backend = layer_idx, mla_backend
        self.num_heads = h = config.num_heads
        self.q_lora_rank, self.kv_lora_rank = m.q_lora_rank, m.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.q_part = m.q_lora_rank or h * m.qk_head_dim
        self.interleaved = config.rope.interleaved
        self.scale = softmax_scale(config.rope, m.qk_head_dim)
        self.prefill_form = "auto"  # PREFILL_FORMS; the engine's mla_prefill sets it
        # the MLA backend's keyword arguments (decode form, prefill_gluon), not only the decode's:
        # set_decode_form and _prefill_kwargs
        self.decode_kwargs: dict = self._prefill_kwargs()
        # "auto"'s longest absorbed row; None: `auto_absorbed_max_context`'s rule
        self.auto_max_context: int | None = None
        # under "auto", fresh prompts' rows (no cached prefix) of at least `fresh_min_tokens`
        # up-projected in one variable-length causal launch (mla/up_projected.attend_fresh_rows);
        # MOESERVE_MLA_FRESH_VARLEN=0 switches it off, for A/Bs
        self.fresh_varlen = envs.mla_fresh_varlen()
        self.fresh_min_tokens = FRESH_VARLEN_MIN_TOKENS
        self.fresh_min_work_beside = FRESH_MIN_WORK_BESIDE_ABSORBED
        # tokens attended in each form, counted on the host when the forward runs eagerly (a
        # CUDA-graph replay runs no Python): tests assert which path ran
        self.reset_path_counters()
        hidden = config.hidden_size
        # [q_a_proj or q_proj | kv_a_proj_with_mqa | extra_in_rows] rows: one GEMM reads the
        # hidden state once
        self.latent_end = self.q_part + m.latent_dim  # in_proj rows [q_part, latent_end): kv_a
        self.in_proj = weights.linear("in_proj", self.latent_end + extra_in_rows, hidden,
                                      dtype=dtype, device=device)
        self.q_a_layernorm = self.q_b_proj = None
        if m.q_lora_rank:
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6, dtype, device)
            self.q_b_proj = weights.linear("q_b_proj", h * m.qk_head_dim, m.q_lora_rank,
                                           dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6, dtype, device)
        self.kv_b_proj = empty_param(h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank,
                                dtype=dtype, device=device)
        w = self.kv_b_proj.view(h, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.w_uk = w[:, :m.qk_nope_head_dim]  # [H, nope, L] view
        self.w_uv = w[:, m.qk_nope_head_dim:]  # [H, v, L] view
        self.o_proj = weights.linear("o_proj", hidden, h * m.v_head_dim, dtype=dtype,
                                     device=device)
        key = (("rope", config.rope),)
        self.cos, self.sin = _pair_table(key, m.qk_rope_head_dim, config.max_position_embeddings,
                                         torch.device(device or "cpu"))  # [P, R / 2]
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, L + R]
        # the latent norm, RoPE and latent write fused into one launch: None on CUDA; tests
        # force True on CPU (Triton's interpreter) or False on CUDA
        self.fused_rope_cache: bool | None = None

    def reset_path_counters(self) -> None:
        """Zero the tokens-per-form counts (the runner calls it after warm-up and capture,
        which are not served load)."""
        self.tokens_absorbed = self.tokens_up_projected = self.tokens_fresh_varlen = 0

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        state = self.pre_attention(positions, hidden, meta.slot_mapping, latent_query=True)
        return self.post_attention(self.attention_core(state, meta))  # [T, hidden]

    # the forward in three parts, as Attention's (piecewise CUDA graphs capture the first and
    # the last)

    @property
    def attention_out_dim(self) -> int:
        """Width of the core's output per token (o_proj's input)."""
        return self.num_heads * self.v_dim

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor,
                      slot_mapping: torch.Tensor, latent_query: bool = False) -> MlaState:
        """hidden [T, h] -> the queries and projections the core needs, with this step's
        latents written at slot_mapping [T]. latent_query: q_rope written into the absorbed
        query's buffer (`Projected.q_lat`) when T x H is at most LATENT_QUERY_MAX_ROWS; the
        forward asks for it, piecewise CUDA graphs (runner/mixed_graphs.py, which copy the
        state into static buffers sized for their largest step) do not."""
        if self.kv_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound (bind_kv_caches)")
        t, heads, nope = hidden.shape[0], self.num_heads, self.nope
        a = linear(hidden, self.in_proj)  # [T, q_part + L + R (+ extra rows)]
        q = q_resid = a[:, :self.q_part]
        if self.q_b_proj is not None:
            q_resid = self.q_a_layernorm(q_resid)  # a strided view: the norm reads it in place
            q = linear(q_resid, self.q_b_proj)
        q = q.view(t, heads, nope + self.rope_dim)
        fused = a.is_cuda if self.fused_rope_cache is None else self.fused_rope_cache
        L = self.kv_lora_rank
        q_lat = (q.new_empty(t, heads, L + self.rope_dim)
                 if latent_query and t * heads <= LATENT_QUERY_MAX_ROWS else None)
        q_rope, cos, sin = self._rope_cache(positions, a, q, slot_mapping, fused,
                                            None if q_lat is None else q_lat[..., L:])
        return MlaState(q[..., :nope], q_rope, Projected(hidden, a, q_resid, cos, sin, q_lat))

    def _rope_cache(self, positions: torch.Tensor, a: torch.Tensor, q: torch.Tensor,
                    slot_mapping: torch.Tensor, fused: bool,
                    q_out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj's output a and q [T, H, nope + R] -> q_rope [T, H, R] (written into q_out
        when given) and cos, sin [T, R / 2] at positions, with the normed latent and rotated
        k_rope written at slot_mapping. fused: one Triton launch (CUDA, or CPU under Triton's
        interpreter in tests: `fused_rope_cache`)."""
        if fused:
            norm = self.kv_a_layernorm
            return mla_rope_cache_triton(a[:, self.q_part:self.latent_end], q, positions,
                                         self.cos, self.sin, norm.weight, norm.eps,
                                         self.kv_cache, slot_mapping, self.interleaved, q_out)
        L = self.kv_lora_rank
        c_kv = self.kv_a_layernorm(a[:, self.q_part:self.q_part + L].contiguous())  # [T, L]
        cos, sin = self.cos[positions], self.sin[positions]  # [T, R / 2]
        q_rope = rotate_pairs(q[..., self.nope:], cos, sin, self.interleaved)  # [T, H, R]
        k_rope = rotate_pairs(a[:, self.q_part + L:self.latent_end], cos, sin,
                              self.interleaved)  # [T, R]
        write_latent(torch.cat([c_kv, k_rope], dim=-1), self.kv_cache, slot_mapping)
        if q_out is not None:
            q_rope = q_out.copy_(q_rope)
        return q_rope, cos, sin

    def attention_core(self, state: MlaState, meta: AttentionMetadata) -> torch.Tensor:
        """The step's attention, [T, H, v]."""
        return self._attend(state.q_nope, state.q_rope, meta, state.proj)

    def post_attention(self, out: torch.Tensor) -> torch.Tensor:
        """The core's output [T, H, v] (or [T, H * v]) -> [T, hidden]."""
        return linear(out.reshape(out.shape[0], -1), self.o_proj)

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                proj: Projected) -> torch.Tensor:
        """The step's attention, [T, H, v]: dense MLA here (DSA overrides it)."""
        return self._dense(q_nope, q_rope, meta, proj.q_lat)

    def _dense(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
               q_lat: torch.Tensor | None = None) -> torch.Tensor:
        """Dense MLA of the step's rows, [T, H, v]: the decode rows absorbed, the other rows
        by `prefill_form`. q_lat: `Projected.q_lat` of these rows, or None."""
        t, heads = q_nope.shape[:2]
        limit = self.absorbed_max_context()
        fresh = self.fresh_varlen and self.prefill_form == "auto"
        form = row_forms(meta.query_lens_np, meta.seq_lens_np, limit, heads,
                         self.fresh_min_tokens if fresh else None, self.fresh_min_work_beside)
        if bool((form == ABSORBED).all()):
            self.tokens_absorbed += t
            return self._absorbed(q_nope, q_rope, meta, q_lat=q_lat)
        out = q_nope.new_empty(t, heads, self.v_dim)
        for sub, tok, sub_form in _split_by_form(meta, form, limit):
            n = len(sub.token_to_req_np)
            if sub_form == ABSORBED:
                self.tokens_absorbed += n
                out[tok] = self._absorbed(q_nope[tok], q_rope[tok], sub)
                continue
            q = torch.cat([q_nope[tok], q_rope[tok]], dim=-1)
            if sub_form == FRESH:
                self.tokens_fresh_varlen += n
                latents = self.kv_cache.view(-1, self.kv_cache.shape[-1])[sub.slot_mapping]
                out[tok] = attend_fresh_rows(q, latents, sub.query_start_loc,
                                             sub.query_lens_np.tolist(), self.scale,
                                             self.kv_b_proj, self.nope, self.v_dim)
            else:
                self.tokens_up_projected += n
                out[tok] = mla_prefill_ref(q, self.kv_cache, sub, self.scale, self.kv_b_proj,
                                           self.nope, self.v_dim)
        return out

    def set_decode_form(self, form: str) -> None:
        """The Triton backend's decode form ("split", "flat", "gluon"; "auto": its own pick). A form
        other than "auto" needs that backend: the torch reference has one form."""
        if form not in DECODE_FORMS:
            raise ValueError(f"mla decode form must be one of {', '.join(DECODE_FORMS)}; "
                             f"got {form!r}")
        if form != "auto" and self.backend is not mla_attention_triton:
            name = getattr(self.backend, "__name__", repr(self.backend))
            raise ValueError(f"mla decode form {form!r} needs the triton attention backend "
                             f"(this layer's MLA backend is {name})")
        self.decode_kwargs = ({} if form == "auto" else {"decode_form": form}) | (
            self._prefill_kwargs())

    def decode_kernel_bounds(self) -> dict[int, str]:
        """Contexts past which this layer's decode runs another kernel (decode_gluon's
        `kernel_bounds`, under the Triton backend in its "auto" or "gluon" form, over the bound
        cache), each with what changes; {} without a cache or under another backend or form."""
        cache = self.kv_cache
        if (cache is None or self.backend is not mla_attention_triton
                or self.decode_kwargs.get("decode_form", "gluon") != "gluon"):
            return {}
        return decode_gluon.kernel_bounds(self.num_heads, cache, self.kv_lora_rank)

    def _prefill_kwargs(self) -> dict:
        """The Triton backend's absorbed prefill not in Gluon, when MOESERVE_MLA_PREFILL_GLUON=0
        (an A/B switch, envs.py)."""
        return ({"prefill_gluon": False}
                if not envs.mla_prefill_gluon() and self.backend is mla_attention_triton else {})

    def absorbed_max_context(self) -> int | float:
        """The longest context a row with several queries may have and attend absorbed, by
        `prefill_form` (decode rows always do)."""
        if self.prefill_form != "auto":
            return {"mha": 0, "absorbed": float("inf")}[self.prefill_form]
        return (self.auto_max_context if self.auto_max_context is not None
                else self.auto_absorbed_max_context())

    def auto_absorbed_max_context(self) -> int:
        """"auto"'s longest absorbed row: GLUON_ABSORBED_MAX_CONTEXT's where this layer's
        absorbed prefill runs in Gluon (the Triton backend, not switched off, over a cache
        decode_gluon takes), AUTO_ABSORBED_MAX_CONTEXT otherwise."""
        cache = getattr(self, "kv_cache", None)
        if (cache is None or self.backend is not mla_attention_triton
                or self.decode_kwargs.get("prefill_gluon") is False
                or not decode_gluon.supports_cache(cache, self.kv_lora_rank)):
            return AUTO_ABSORBED_MAX_CONTEXT
        return GLUON_ABSORBED_MAX_CONTEXT

    def _absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                  attend: MlaBackend | None = None, q_lat: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """q_nope [T, H, nope], q_rope [T, H, R] -> [T, H, v] through the latent cache, by
        `attend` (default: the MLA backend). q_lat: the latent query [T, H, L + R] whose last
        R columns are q_rope already (`Projected.q_lat`), filled here; None: a new one."""
        return self._attend_latent(self._latent_queries(q_nope, q_rope, q_lat), meta, attend)

    def _latent_queries(self, q_nope: torch.Tensor, q_rope: torch.Tensor,
                        q_lat: torch.Tensor | None) -> torch.Tensor:
        """The absorbed queries [T, H, L + R]: [q_nope W_UK | q_rope], into q_lat where given
        (its last R columns q_rope already), else a new tensor."""
        # both products are written in place (cuBLAS takes the strided views), not cat and
        # copied after: at GLM-4.7-Flash's 1,024-row decode step the cat alone took 2.7 ms of
        # 38 (benchmarks/results/gpu_b9de9a5/call4_1ccc02b, "CatArrayBatchedCopy")
        t, heads = q_nope.shape[:2]
        L = self.kv_lora_rank
        q_full = q_lat
        if q_full is None:
            q_full = q_nope.new_empty(t, heads, L + q_rope.shape[-1])  # [T, H, L + R]
            q_full[..., L:] = q_rope
        torch.bmm(q_nope.transpose(0, 1), self.w_uk, out=q_full[..., :L].transpose(0, 1))
        return q_full

    def _attend_latent(self, q_full: torch.Tensor, meta: AttentionMetadata,
                       attend: MlaBackend | None) -> torch.Tensor:
        """The absorbed queries' attention over the latent cache (by `attend`, default the
        MLA backend), up-projected by W_UV: [T, H, v]."""
        t, heads = q_full.shape[:2]
        L = self.kv_lora_rank
        if attend is None:
            out_lat = self.backend(q_full, self.kv_cache, meta, self.scale, L,
                                   **self.decode_kwargs)
        else:
            out_lat = attend(q_full, self.kv_cache, meta, self.scale, L)
        out = out_lat.new_empty(t, heads, self.v_dim)  # [T, H, v], o_proj's rows as they are
        torch.bmm(out_lat.transpose(0, 1), self.w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out


def row_forms(query_lens: np.ndarray, seq_lens: np.ndarray, limit: int | float, heads: int,
              fresh_min_tokens: int | None, fresh_min_work_beside: int) -> np.ndarray:
    """Each row's prefill form [B] int8 under "auto": ABSORBED for a decode row (one query)
    or a context of at most `limit` tokens, MHA for a longer one, FRESH for a prompt with no
    cached prefix of at least `fresh_min_tokens` queries (None: no fresh launch), unless rows
    beside it still attend absorbed and the fresh rows' work (`heads` x the sum of their squared
    lengths) is under `fresh_min_work_beside`: then they keep their own form (a fresh row past
    `limit` keeps the fresh launch, the same up-projected form in one launch)."""
    form = np.where((query_lens == 1) | (seq_lens <= limit), ABSORBED, MHA).astype(np.int8)
    if fresh_min_tokens is None:
        return form
    fresh = (query_lens >= max(2, fresh_min_tokens)) & (seq_lens == query_lens)
    if fresh.any() and (form[~fresh] == ABSORBED).any():
        work = heads * int((query_lens[fresh].astype(np.int64) ** 2).sum())
        if work < fresh_min_work_beside:
            fresh &= form == MHA
    form[fresh] = FRESH
    return form


def _split_by_form(meta: AttentionMetadata, form: np.ndarray, limit: int | float
                   ) -> list[tuple[AttentionMetadata, slice | torch.Tensor, int]]:
    """The step's rows of each form (ABSORBED, MHA, FRESH: `form` [B]) as sub-steps (metadata,
    token selector, form), made by its first MLA layer and reused by the others
    (`meta.derived`, keyed by the limit and the forms): one set of host copies a step, not one
    a layer; the sub-steps' own derived tensors are shared too."""
    key = ("mla_split", limit, form.tobytes())
    if key not in meta.derived:
        meta.derived[key] = [(*select_rows(meta, rows), f)
                             for f in (ABSORBED, MHA, FRESH)
                             if len(rows := np.flatnonzero(form == f))]
    return meta.derived[key]
