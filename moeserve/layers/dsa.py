"""DeepSeek Sparse Attention (GLM-5, DeepSeek-V3.2): MLA whose long-context rows attend only to
the positions a lightning indexer selects.

One forward of a DSA layer (on top of layers/mla.py's MLA; Hi heads of D, R rotary dims):

    in_proj rows [q_a | kv_a | wk]: the indexer key projection rides the same GEMM
    "full" layer, every token:  k_idx = LayerNorm(wk(x)), RoPE on k_idx[:R] -> index_cache[slot]
    rows whose context <= index_topk (or dsa_mode "dense"): dense MLA (layers/mla.py), the same
        result as selecting everything, at no indexer cost but the key write
    the other rows:
      "full" layer:   q_idx = wq_b(q_lora output) [T, Hi, D], RoPE on q_idx[..., :R];
                      w = weights_proj(x) (fp32) / sqrt(Hi)
                      positions [T, index_topk] = indexer top-k(q_idx, w, index_cache)
      "shared" layer: the positions of the last full layer before it, this step
      out = absorbed MLA over those positions only -> W_UV -> o_proj

The indexer's top-k and the sparse MLA are the Triton kernels (kernels/attention/dsa/)
when the layer's MLA backend is the Triton one, the torch references (dsa/reference.py) otherwise
(kernels/registry.py's `dsa_backend_for`); both select the same positions, ties included.

The indexer's RoPE splits [rope | pass] (the main attention's q is [nope | rope]), in pairs for
GLM-5 and in halves for V3.2, as each model's transformers code. The selection of a step's
full layer is kept in `meta.derived` for the shared layers after it; the rows' split into
sparse and dense is made once per step (also in `meta.derived`). A step whose
`meta.max_seq_len` (an upper bound on every row's context) is at most index_topk runs dense
whatever else it knows: the CUDA-graph decode's graph of the smallest context bound, for
steps whose contexts all lie within index_topk (runner/cuda_graphs.py), so short-context
serving pays no indexer. Otherwise, when the host lengths are not the real ones (a CUDA-graph
decode: `meta.exact_host_lens` False) every row takes the sparse path, which selects every
position of a context of at most index_topk: the same result without a host decision.

`dsa_mode`: "auto" (above), "dense" (never sparse: the engine's dsa="dense"; the keys are
still written when an indexer cache is bound) or "sparse" (every row sparse: tests, to show
it equals dense below index_topk).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moeserve import envs
from moeserve.kernels.attention.dsa.indexer_rope_triton import (
    indexer_keys_triton,
    indexer_q_rope_triton,
    rope_first,
)
from moeserve.kernels.attention.dsa.reference import write_index_keys
from moeserve.kernels.attention.metadata import AttentionMetadata, select_rows
from moeserve.kernels.registry import DsaBackend, IndexerTopkFn, dsa_backend_for
from moeserve.kernels.triton_common import queries_made_earlier
from moeserve.layers.linear import WeightFactory, linear
from moeserve.layers.mla import MlaBackend, MLAttention, Projected
from moeserve.layers.norm import LayerNorm
from moeserve.layers.params import empty_param
from moeserve.model_config import ModelConfig

DSA_MODES = ("auto", "dense", "sparse")
# The indexer's key norm, RoPE and cache write, and its query's RoPE, each one Triton launch on
# CUDA (kernels/attention/dsa/indexer_rope_triton.py) in place of about twenty small torch
# launches a full layer and step. On an H100 in CUDA graphs (benchmarks/results/gpu_56e6f7e/
# call1, kernels_dsa's indexer_rope_graph_ms) 0.0107 against 0.0497 ms at 32 decode tokens,
# 0.0126 against 0.0574 at 256; MOESERVE_DSA_FUSED_INDEXER=0 turns it off (a served A/B);
# `Indexer.fused` forces either way
FUSED_ON_CUDA = envs.dsa_fused_indexer()


class DsaLayerCache(NamedTuple):
    """A full DSA layer's cache tensors, paged alike (the same blocks and slots)."""

    latent: torch.Tensor  # [num_blocks, block_size, L + R]
    index_keys: torch.Tensor  # [num_blocks, block_size, index_head_dim]


class Indexer(nn.Module):
    """The lightning indexer of a full layer: its query and weight projections, its key norm
    (wk itself is rows of the attention's in_proj)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None,
                 device: torch.device | str | None, topk_fn: IndexerTopkFn,
                 weights: WeightFactory | None = None) -> None:
        super().__init__()
        weights = weights or WeightFactory()
        self.topk_fn = topk_fn
        d, m = config.dsa, config.mla
        assert d is not None and m is not None and m.q_lora_rank
        self.heads, self.head_dim, self.rope_dim = d.index_n_heads, d.index_head_dim, \
            m.qk_rope_head_dim
        self.interleaved = d.rope_interleaved
        self.scale = d.index_head_dim ** -0.5
        self.wq_b = weights.linear("wq_b", d.index_n_heads * d.index_head_dim, m.q_lora_rank,
                                   dtype=dtype, device=device)
        self.k_norm = LayerNorm(d.index_head_dim, 1e-6, dtype, device)
        # fp32, as transformers keeps it (_keep_in_fp32_modules), and computed in fp32
        self.weights_proj = empty_param(d.index_n_heads, config.hidden_size,
                                        dtype=torch.float32, device=device)
        self.count_ties = False  # tests: count selections with a tie at the k-th place
        self.boundary_ties = 0
        # the fused key / query launches: None, on CUDA when FUSED_ON_CUDA; True / False
        # forced (tests: True runs them on CPU under Triton's interpreter)
        self.fused: bool | None = None

    def _fused(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and FUSED_ON_CUDA) if self.fused is None else self.fused

    def keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """wk(x) [T, D] -> the cached keys LayerNorm(.) with RoPE on the first R dims."""
        return rope_first(self.k_norm(k), cos, sin, self.interleaved)

    def write_keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's keys (`keys`) written into the indexer cache at slot_mapping."""
        if self._fused(k):
            indexer_keys_triton(k, cos, sin, self.k_norm.weight, self.k_norm.bias,
                                self.k_norm.eps, index_cache, slot_mapping, self.interleaved)
        else:
            write_index_keys(self.keys(k, cos, sin), index_cache, slot_mapping)

    def select(self, q_resid: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata,
               topk: int) -> torch.Tensor:
        """The top-k context positions [T, topk] int32 (-1: none) of the step's tokens."""
        q = linear(q_resid, self.wq_b).view(-1, self.heads, self.head_dim)
        q = (indexer_q_rope_triton(q, cos, sin, self.interleaved) if self._fused(q)
             else rope_first(q, cos, sin, self.interleaved))  # [T, Hi, D]
        w = F.linear(hidden.float(), self.weights_proj) * self.heads ** -0.5  # [T, Hi]
        pos, ties = self.topk_fn(q, w, index_cache, meta, self.scale, topk,
                                 count_boundary_ties=self.count_ties)
        self.boundary_ties += ties
        return pos


class DsaAttention(MLAttention):
    def __init__(self, layer_idx: int, config: ModelConfig, mla_backend: MlaBackend,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None,
                 weights: WeightFactory | None = None) -> None:
        d = config.dsa
        assert d is not None
        full = d.is_full(layer_idx)
        weights = weights or WeightFactory()
        super().__init__(layer_idx, config, mla_backend, dtype, device,
                         extra_in_rows=d.index_head_dim if full else 0, weights=weights)
        self.topk = d.index_topk
        self.source_layer = d.source_layer(layer_idx)  # whose selection this layer uses
        self.dsa_ops: DsaBackend = dsa_backend_for(mla_backend)
        self.indexer = (Indexer(config, dtype, device, self.dsa_ops.indexer_topk,
                                weights.child("indexer")) if full else None)
        self.index_cache: torch.Tensor | None = None  # [num_blocks, block_size, D]: full only
        self.dsa_mode = "auto"

    def reset_path_counters(self) -> None:
        """MLA's counts, the tokens attended sparsely (host count, eager forwards) and the
        indexer's boundary ties."""
        super().reset_path_counters()
        self.tokens_sparse = 0
        indexer = self.__dict__.get("_modules", {}).get("indexer")  # absent during __init__
        if indexer is not None:
            indexer.boundary_ties = 0

    def bind_cache(self, cache: torch.Tensor | DsaLayerCache | None) -> None:
        """A full layer takes a DsaLayerCache (or the latent alone: then only dsa_mode
        "dense" runs); a shared layer the latent tensor."""
        if isinstance(cache, DsaLayerCache):
            if self.indexer is None:
                raise ValueError(f"layer {self.layer_idx} is a shared DSA layer: it has no "
                                 "indexer cache")
            self.kv_cache, self.index_cache = cache
        else:
            self.kv_cache, self.index_cache = cache, None

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                proj: Projected) -> torch.Tensor:
        if self.indexer is not None and self.index_cache is not None:
            self.indexer.write_keys(proj.proj[:, self.latent_end:], proj.cos, proj.sin,
                                    self.index_cache, meta.slot_mapping)
        if self.dsa_mode == "dense":
            return self._dense(q_nope, q_rope, meta, proj.q_lat)
        if self.indexer is not None and self.index_cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no indexer key cache bound (the "
                               "engine's dsa='dense' allocates none): only dsa_mode 'dense' "
                               "can run")
        sparse, dense = _split_rows(meta, self.topk, self.dsa_mode)
        if sparse is None:
            return self._dense(q_nope, q_rope, meta, proj.q_lat)
        out = q_nope.new_empty(*q_nope.shape[:2], self.v_dim)
        for part, run_sparse in ((sparse, True), (dense, False)):
            if part is None:
                continue
            sub, tok = part
            q_n, q_r = (q_nope, q_rope) if tok is None else (q_nope[tok], q_rope[tok])
            if run_sparse:
                o = self._sparse(q_n, q_r, sub, proj, tok)
            else:
                o = self._dense(q_n, q_r, sub)
            if tok is None:
                return o
            out[tok] = o
        return out

    def _sparse(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                proj: Projected, tok: torch.Tensor | None) -> torch.Tensor:
        """The sparse rows (`meta` is theirs; `tok` their tokens in the step, None: all). The
        absorbed queries are made before the indexer's selection, so that its scores, top-k,
        the sparse MLA and its split combine run back to back (each waits for the one before
        it only: triton_common.pdl)."""
        q_full = self._latent_queries(q_nope, q_rope, proj.q_lat if tok is None else None)
        key = ("dsa_topk", self.source_layer, self.dsa_mode)
        if self.indexer is not None:
            pick = (lambda x: x) if tok is None else (lambda x: x[tok])
            meta.derived[key] = self.indexer.select(
                pick(proj.q_resid), pick(proj.hidden), pick(proj.cos), pick(proj.sin),
                self.index_cache, meta, self.topk)
        elif key not in meta.derived:
            raise RuntimeError(f"layer {self.layer_idx} shares the selection of layer "
                               f"{self.source_layer}, which made none this step (dsa_mode "
                               f"{self.dsa_mode!r})")
        positions = meta.derived[key]  # [n, topk]
        self.tokens_sparse += q_nope.shape[0]

        def attend(q: torch.Tensor, cache: torch.Tensor, m: AttentionMetadata, scale: float,
                   rank: int) -> torch.Tensor:
            return self.dsa_ops.attention(q, cache, m, positions, scale, rank, packed=True)

        if self.indexer is None:  # a shared layer: its queries come from the launch just before
            return self._attend_latent(q_full, meta, attend)
        with queries_made_earlier():  # before the indexer's launches (triton_common.pdl)
            return self._attend_latent(q_full, meta, attend)


def _split_rows(meta: AttentionMetadata, topk: int, mode: str) -> tuple:
    """The step's rows as (sparse part, dense part), each None or (its metadata, its token
    indices in the step or None for all). "sparse": every row sparse. "auto": every row dense
    when meta.max_seq_len (a bound on each row's context) is at most topk; else with exact host
    lengths the rows of context > topk sparse, the others dense; without them every row
    sparse. Made once per step; the sparse part's metadata is the one object every layer of
    the step stores its selection in. `meta.derived` never holds `meta`
    itself: that cycle left every step's metadata, with its selections, to the garbage
    collector, and W3's 32k prompts on the H200 grew by gigabytes until out of memory."""
    key = ("dsa_split", topk, mode)
    if key not in meta.derived:
        if mode == "sparse":
            split = _WHOLE_SPARSE
        elif meta.max_seq_len <= topk:  # a bound on every row, exact host lengths or not
            split = _WHOLE_DENSE
        elif not meta.exact_host_lens:
            split = _WHOLE_SPARSE
        else:
            long = meta.seq_lens_np > topk
            if bool(long.all()):
                split = _WHOLE_SPARSE
            elif not long.any():
                split = _WHOLE_DENSE
            else:
                split = (select_rows(meta, np.flatnonzero(long)),
                         select_rows(meta, np.flatnonzero(~long)))
        meta.derived[key] = split
    split = meta.derived[key]
    if split is _WHOLE_SPARSE:
        return (meta, None), None
    if split is _WHOLE_DENSE:
        return None, (meta, None)
    return split


# _split_rows' cached answer when one part is the whole step (resolved to `meta` on return)
_WHOLE_SPARSE, _WHOLE_DENSE = "whole step sparse", "whole step dense"
