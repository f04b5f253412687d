"""Which shard of the model a rank holds: the split of W ranks, checked against the model.

Torch-free (the API process and the capacity report read it). W = the world size
(`tensor_parallel_size`, over all nodes). Attention, dense MLPs, shared experts and the
vocabulary split over all W ranks; the routed experts split as MoE-TP x EP = W:

    ep_rank = rank // moe_tp     holds experts [ep_rank * E / EP, (ep_rank + 1) * E / EP)
    moe_tp_rank = rank % moe_tp  holds each of them's intermediate rows [r * I / moe_tp, ...)

GQA KV heads split when there are at least W of them, else each rank holds one, KV head
(rank * KVH) // W (replicated: the query heads it serves all read that head). MLA's latent
cache and DSA's indexer are whole on every rank (docs/parallel.md says why).

`local_model_config` is the ModelConfig a rank builds its layers from: the head counts and
widths divided, everything else (num_experts included: the router sees all of them) as is.
A split that does not divide a size is refused with a ConfigError naming both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from moeserve.model_config import ConfigError, ModelConfig


@dataclass(frozen=True, slots=True)
class RankLayout:
    """The split of the world and this rank's place in it."""

    world_size: int = 1
    rank: int = 0
    expert_parallel_size: int = 1  # EP; the MoE's TP is world_size // EP

    def __post_init__(self) -> None:
        w, ep = self.world_size, self.expert_parallel_size
        if w < 1 or not 0 <= self.rank < w:
            raise ConfigError(f"rank {self.rank} is not in a world of {w}")
        if ep < 1 or w % ep:
            raise ConfigError(f"expert_parallel_size {ep} must divide the world size {w} "
                              "(MoE TP x EP = tensor_parallel_size)")

    @property
    def moe_tp(self) -> int:
        return self.world_size // self.expert_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    def for_rank(self, rank: int) -> RankLayout:
        return dataclasses.replace(self, rank=rank)

    def describe(self) -> str:
        """One line: "W ranks: attention TP W, MoE TP m x EP e"."""
        if self.world_size == 1:
            return "1 rank"
        return (f"{self.world_size} ranks: attention and dense layers TP {self.world_size}, "
                f"MoE TP {self.moe_tp} x EP {self.expert_parallel_size}")


def check_devices(ranks_per_node: int, device_type: str, num_gpus: int) -> None:
    """A node's ranks need a GPU each (ConfigError naming both counts)."""
    if device_type == "cuda" and ranks_per_node > num_gpus:
        raise ConfigError(f"{ranks_per_node} ranks a node (tensor_parallel_size / nnodes) need "
                          f"{ranks_per_node} GPUs on each node; this one has {num_gpus}")


def split(total: int, parts: int, what: str) -> int:
    """total / parts, or a ConfigError naming `what` when it does not divide."""
    if total % parts:
        raise ConfigError(f"{what} ({total}) is not divisible by the {parts} ranks it is split "
                          "over; choose a tensor_parallel_size (or expert_parallel_size) that "
                          "divides it")
    return total // parts


def local_kv_heads(num_kv_heads: int, world_size: int) -> int:
    """KV heads a rank holds: KVH / W, or 1 (replicated) when W exceeds KVH."""
    if num_kv_heads >= world_size:
        return split(num_kv_heads, world_size, "num_key_value_heads")
    if world_size % num_kv_heads:
        raise ConfigError(f"num_key_value_heads ({num_kv_heads}) must divide the world size "
                          f"{world_size} when it is smaller (each KV head is replicated over "
                          "W / KVH ranks)")
    return 1


def kv_head_start(num_kv_heads: int, layout: RankLayout) -> int:
    """The first of the KV heads this rank holds."""
    w = layout.world_size
    if num_kv_heads >= w:
        return layout.rank * (num_kv_heads // w)
    return layout.rank * num_kv_heads // w


def local_model_config(mc: ModelConfig, layout: RankLayout) -> ModelConfig:
    """The shapes a rank builds its layers with (see the module doc); mc itself at W = 1."""
    w = layout.world_size
    if w == 1:
        return mc
    check_layout(mc, layout)
    heads = mc.num_heads // w
    kv = heads if mc.mla is not None else local_kv_heads(mc.num_kv_heads, w)
    return dataclasses.replace(
        mc, num_heads=heads, num_kv_heads=kv,
        intermediate_size=mc.intermediate_size // w,
        moe_intermediate_size=mc.moe_intermediate_size // layout.moe_tp,
        shared_expert_intermediate_size=mc.shared_expert_intermediate_size // w)


def check_layout(mc: ModelConfig, layout: RankLayout) -> None:
    """Every size the layout divides, divided exactly (ConfigError naming the first that is
    not)."""
    w = layout.world_size
    split(mc.num_heads, w, "num_attention_heads")
    if mc.mla is None:
        local_kv_heads(mc.num_kv_heads, w)
    if mc.num_experts:
        split(mc.num_experts, layout.expert_parallel_size, "n_routed_experts (num_experts)")
        split(mc.moe_intermediate_size, layout.moe_tp, "moe_intermediate_size")
    elif layout.expert_parallel_size > 1:
        raise ConfigError(f"expert parallelism over {layout.expert_parallel_size} ranks needs a "
                          f"MoE model; {mc.architecture} has no routed experts")
    if any(not mc.is_moe_layer(i) for i in range(mc.num_layers)):
        split(mc.intermediate_size, w, "intermediate_size (the dense MLP layers)")
    if mc.shared_expert_intermediate_size:
        split(mc.shared_expert_intermediate_size, w, "the shared experts' intermediate size")


def local_vocab(vocab_size: int, layout: RankLayout) -> tuple[int, int]:
    """(first row, rows) of the embedding and LM head a rank holds: ceil(V / W) rows each, the
    last rank's past V padding (zero rows; their logits are cut before sampling)."""
    per = -(-vocab_size // layout.world_size)
    return layout.rank * per, per


def local_experts(num_experts: int, layout: RankLayout) -> tuple[int, int]:
    """(first expert, count) of the routed experts a rank holds."""
    per = num_experts // layout.expert_parallel_size
    return layout.ep_rank * per, per


class SplitBreak(NamedTuple):
    """A row-parallel weight class whose per-rank columns (K) cut its quantization groups."""

    what: str  # e.g. "each expert's down_proj"
    suffix: str  # the weights' path suffix in the model (".mlp.w2")
    columns: int  # this rank's columns

    def line(self, fmt: str, group: int) -> str:
        return f"{self.what}: {self.columns} columns a rank cut the {fmt} groups of {group}"


def quantized_split_breaks(mc: ModelConfig, layout: RankLayout) -> list[SplitBreak]:
    """The row-parallel splits whose columns a rank holds cut a quantized checkpoint's scale
    groups along K (FP8: 128, NVFP4: 16, INT4: its group); [] when none. Row (N) splits never
    do: the in-memory layout keeps a scale row per weight row (quant/packed.py). The plan holds
    such weights in the engine's dtype, dequantized as each rank copies its slice (exact)."""
    q, w = mc.quantization, layout.world_size
    if q is None or w == 1:
        return []
    group = 128 if q.format == "fp8" else q.group_size
    heads = mc.num_heads // w
    v = mc.mla.v_head_dim if mc.mla is not None else mc.head_dim
    cols = [SplitBreak("o_proj", ".self_attn.o_proj", heads * v)]
    if any(not mc.is_moe_layer(i) for i in range(mc.num_layers)):
        cols.append(SplitBreak("the dense MLP's down_proj", ".mlp.down_proj",
                               mc.intermediate_size // w))
    if mc.num_experts and layout.moe_tp > 1:
        cols.append(SplitBreak("each expert's down_proj", ".mlp.w2",
                               mc.moe_intermediate_size // layout.moe_tp))
    if mc.shared_expert_intermediate_size:
        cols.append(SplitBreak("the shared experts' down_proj", ".mlp.shared_experts.down_proj",
                               mc.shared_expert_intermediate_size // w))
    return [c for c in cols if c.columns % group]
