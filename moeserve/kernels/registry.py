"""Kernel backends by name: layers pick their attention and MoE implementation here, once.

`moe_backend` / `attention_backend` names from the engine config map to functions with one
shared signature per op. Triton modules import triton lazily, so importing this registry never
imports triton.

    MOE_BACKENDS        torch -> moe_loop_ref, grouped_mm -> moe_grouped_mm, triton -> moe_triton,
                        measured -> moe_measured (per token count, the faster of the two as
                        the tune measured it; Triton with default tiles when untuned)
    ATTENTION_BACKENDS  torch -> paged_attention_ref, triton -> paged_attention_triton
    MLA_BACKENDS        torch -> mla_attention_ref, triton -> mla_attention_triton (absorbed
                        MLA over the paged latent cache)
    DSA_BACKENDS        torch -> attention/dsa/reference.py, triton -> those of
                        dsa/indexer_triton.py (the indexer's top-k, MLA over the selection); a DSA
                        layer takes the pair named like its MLA backend (`dsa_backend_for`)

The MoE tile source (the engine's `moe_tiles`) is bound here too, into the backends that read
tile configs (TILED_MOE_BACKENDS): `get_moe_backend("triton", tiles="default")` is moe_triton
with `tiles="default"` on every call, so no layer looks a global up; `moe_tile_source` reads it
back for the quantized experts' own kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol, TypeVar

import torch

from moeserve.kernels.attention.dsa.indexer_triton import indexer_topk_triton
from moeserve.kernels.attention.dsa.reference import dsa_attention_ref, indexer_topk_ref
from moeserve.kernels.attention.dsa.sparse_triton import dsa_attention_triton
from moeserve.kernels.attention.metadata import AttentionMetadata
from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from moeserve.kernels.attention.paged import paged_attention_ref
from moeserve.kernels.attention.paged_triton import paged_attention_triton
from moeserve.kernels.moe.fused_triton import moe_triton
from moeserve.kernels.moe.grouped_mm import moe_grouped_mm
from moeserve.kernels.moe.measured import moe_measured
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.moe.tile_configs import check_tile_source


class MoeFn(Protocol):
    """(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k])
    -> [T, H]; with reduce=False -> [T, S, H] parts whose sum over S is that result (the
    decoder layer passes them to the next norm, which adds them: no pass of their own). A
    topk_ids entry of -1 (expert parallelism: the expert is on another rank; ids >= 0 index
    w13's E local experts) contributes exactly zero and costs no expert compute."""

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 reduce: bool = True) -> torch.Tensor: ...


class AttentionFn(Protocol):
    """(q [T, H, D], kv_cache [2, num_blocks, block_size, KVH, D], meta, scale) -> [T, H, D]."""

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float) -> torch.Tensor: ...


class MlaAttentionFn(Protocol):
    """Absorbed MLA: (q [T, H, L + R], latent_cache [num_blocks, block_size, L + R], meta, scale,
    kv_lora_rank L) -> [T, H, L]."""

    def __call__(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, kv_lora_rank: int) -> torch.Tensor: ...


class IndexerTopkFn(Protocol):
    """(q [T, Hi, D], weights [T, Hi] fp32, index_cache [num_blocks, block_size, D], meta, scale,
    topk, count_boundary_ties) -> (positions [T, topk] int32, -1: none; boundary ties)."""

    def __call__(self, q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, topk: int,
                 count_boundary_ties: bool = False) -> tuple[torch.Tensor, int]: ...


class DsaAttentionFn(Protocol):
    """(q [T, H, L + R], latent_cache, meta, positions [T, topk] int32, scale, L) -> [T, H, L];
    packed: the positions are an indexer's (valid ones first, at most position + 1 of them),
    which a backend may use to stop early."""

    def __call__(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata,
                 positions: torch.Tensor, scale: float, kv_lora_rank: int,
                 packed: bool = False) -> torch.Tensor: ...


class DsaBackend(NamedTuple):
    """DeepSeek Sparse Attention's two ops."""

    indexer_topk: IndexerTopkFn
    attention: DsaAttentionFn


_Fn = TypeVar("_Fn")

MOE_BACKENDS: dict[str, MoeFn] = {"torch": moe_loop_ref, "grouped_mm": moe_grouped_mm,
                                  "triton": moe_triton, "measured": moe_measured}
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"torch": paged_attention_ref,
                                              "triton": paged_attention_triton}
MLA_BACKENDS: dict[str, MlaAttentionFn] = {"torch": mla_attention_ref,
                                           "triton": mla_attention_triton}
DSA_BACKENDS: dict[str, DsaBackend] = {
    "torch": DsaBackend(indexer_topk_ref, dsa_attention_ref),
    "triton": DsaBackend(indexer_topk_triton, dsa_attention_triton)}
TILED_MOE_BACKENDS = ("triton", "measured")  # the MoE backends that read tile configs


def get_moe_backend(name: str, tiles: str = "tuned") -> MoeFn:
    """The MoE experts function registered as `name`; ValueError naming the choices if none.

    tiles: the tile source of TILED_MOE_BACKENDS (`moe_configs.TILE_SOURCES`): "tuned" gives
    the function itself (its default), "default" the function bound to `tiles="default"`; the
    other backends have no tiles and ignore it.
    """
    fn = _lookup("moe_backend", MOE_BACKENDS, name)
    check_tile_source(tiles)
    if tiles == "tuned" or name not in TILED_MOE_BACKENDS:
        return fn
    return functools.partial(fn, tiles=tiles)


def bind_routed_experts(backend: MoeFn, routed_experts: int) -> MoeFn:
    """`backend` for a rank that holds some of the model's `routed_experts` (expert
    parallelism): the TILED_MOE_BACKENDS look their tiles up at that rank's density
    (`tile_configs.tile_tokens`); the others, with no tiles, are returned as they are."""
    fn = getattr(backend, "func", backend)
    if fn not in (MOE_BACKENDS[name] for name in TILED_MOE_BACKENDS):
        return backend
    return functools.partial(backend, routed_experts=routed_experts)


def moe_tile_source(backend: MoeFn) -> str:
    """The tile source `get_moe_backend` bound into `backend` ("tuned" unless bound to another):
    quantized experts, which run their own kernel whatever the backend, follow it."""
    keywords = getattr(backend, "keywords", None) or {}
    return keywords.get("tiles", "tuned")


def get_attention_backend(name: str) -> AttentionFn:
    """The attention function registered as `name`; ValueError naming the choices if none."""
    return _lookup("attention_backend", ATTENTION_BACKENDS, name)


def get_mla_backend(name: str) -> MlaAttentionFn:
    """The absorbed MLA attention function registered as `name`; ValueError naming the choices
    if none."""
    return _lookup("mla_backend", MLA_BACKENDS, name)


def dsa_backend_for(mla_backend: object) -> DsaBackend:
    """The DSA ops registered under the name of `mla_backend` (an MLA_BACKENDS function); the
    torch references for any other function (a test's own, a wrapper)."""
    name = next((n for n, fn in MLA_BACKENDS.items() if fn is mla_backend), "torch")
    return DSA_BACKENDS[name]


def _lookup(kind: str, table: dict[str, _Fn], name: str) -> _Fn:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choices: {', '.join(sorted(table))}") from None
