"""fold_shared_experts (layers/moe.py): a MoE block's shared experts appended to its routed
stack as always-selected experts give the block's output of the separate MLP (fp32, to
summation order), as one MoE op with S more pairs a token; the blocks it cannot fold say why.
End to end against transformers: tests/engine/test_mla_families_vs_hf.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.config import load_model_config
from moeserve.kernels.registry import get_moe_backend
from moeserve.layers.linear import WeightFactory
from moeserve.layers.moe import SparseMoeBlock
from moeserve.quant.packed import QuantWeight
from moeserve.quant.plan import QuantPlan


def _block(shared_factor: int, seed: int = 0, **kw) -> SparseMoeBlock:
    """tiny-moe's block with shared experts of shared_factor x the expert width, random."""
    mc = load_model_config("tiny-moe")[0]
    mc = dataclasses.replace(mc, shared_expert_intermediate_size=(
        mc.moe_intermediate_size * shared_factor))
    block = SparseMoeBlock(mc, get_moe_backend("torch"), torch.float32, "cpu", **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block


@pytest.mark.parametrize("factor", [1, 2])
def test_a_folded_block_gives_the_separate_mlps_output(factor: int) -> None:
    block = _block(factor)
    e, width = block.w13.shape[0], block.w2.shape[-1]
    x = torch.randn(13, block.w13.shape[-1], generator=torch.Generator().manual_seed(1))
    whole, parts = block(x), block(x, reduce=False)  # [T, H], [T, k + 1, H]
    mlp_down = block.shared_experts.down_proj.clone()
    assert block.fold_shared_experts() == ""
    assert block.shared_experts is None and block.folded_shared == factor
    assert block.w13.shape == (e + factor, 2 * width, x.shape[1])
    assert block.w2.shape == (e + factor, x.shape[1], width)
    # the last expert's down weights are the MLP's last chunk of intermediate columns
    assert torch.equal(block.w2[-1], mlp_down[:, -width:])
    torch.testing.assert_close(block(x), whole, rtol=1e-5, atol=1e-6)
    folded_parts = block(x, reduce=False)  # the MoE op's parts alone: no MLP part after them
    torch.testing.assert_close(folded_parts.sum(1), parts.sum(1), rtol=1e-5, atol=1e-6)


def test_routing_and_expert_counts_are_the_routed_experts_alone() -> None:
    block, folded = _block(1), _block(1)
    assert folded.fold_shared_experts() == ""
    for b in (block, folded):
        b.expert_counts = torch.zeros(b.num_local_experts, dtype=torch.int64)
    x = torch.randn(9, block.w13.shape[-1], generator=torch.Generator().manual_seed(2))
    block(x), folded(x)
    assert torch.equal(block.expert_counts, folded.expert_counts)
    assert int(folded.expert_counts.sum()) == 9 * block.top_k


def test_blocks_it_cannot_fold_say_why() -> None:
    mc = load_model_config("tiny-moe")[0]
    odd = dataclasses.replace(mc, shared_expert_intermediate_size=mc.moe_intermediate_size + 8)
    block = SparseMoeBlock(odd, get_moe_backend("torch"), torch.float32, "cpu")
    assert "is not a multiple of the experts'" in block.fold_shared_experts()
    assert block.shared_experts is not None and block.folded_shared == 0
    e = mc.num_experts
    sharded = _block(1, experts=(0, e // 2))
    assert "expert parallelism" in sharded.fold_shared_experts()
    shared = dataclasses.replace(mc, shared_expert_intermediate_size=mc.moe_intermediate_size)
    quantized = SparseMoeBlock(shared, get_moe_backend("torch"), torch.float32, "cpu",
                               weights=WeightFactory(QuantPlan("int4", 32)))
    assert isinstance(quantized.w13, QuantWeight)
    assert quantized.fold_shared_experts() == "quantized weights"
    none = SparseMoeBlock(mc, get_moe_backend("torch"), torch.float32, "cpu")
    assert none.shared_experts is None and none.fold_shared_experts() == ""


def test_unfolded_shared_experts_add_into_the_first_part_in_place() -> None:
    """reduce=False: the shared MLP's output is added into the first routed part (by its down
    GEMM's epilogue, on the part as a strided view of the [T, k, H] parts), so the parts sum
    to the reduced output and stay the backend's own tensor."""
    block = _block(2)
    x = torch.randn(11, block.w13.shape[-1], generator=torch.Generator().manual_seed(3))
    routed = torch.randn(11, 3, x.shape[1], generator=torch.Generator().manual_seed(4))
    block.backend = lambda *args, reduce: routed.clone() if reduce is False else None
    parts = block(x, reduce=False)
    assert parts.shape == routed.shape and parts.is_contiguous()
    torch.testing.assert_close(parts[:, 1:], routed[:, 1:], rtol=0, atol=0)
    torch.testing.assert_close(parts.sum(1), routed.sum(1) + block.shared_experts(x),
                               rtol=1e-5, atol=1e-5)
