"""The NVFP4 fused MoE's decode and activation-layout variants give the same bits: the inline-PTX
"asm" nibble decode against "bits" (and where each runs), and `a_halves` (the activations
stored in even / odd halves) against the in-register split. Helpers and shapes are
test_moe_quant_triton.py's."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.kernels.moe.test_moe_quant_triton import (
    GPU_SHAPE,
    experts,
    gpu_experts,
    make_weight,
    rel_err,
    routing,
    tokens,
)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_nvfp4_asm_decode_gives_the_same_bits(num_tokens: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """nvfp4_tile's "asm" decode (inline PTX, what "auto" takes here) against "bits": the
    same dequantized tiles, so the same output bits."""
    from moeserve.kernels.linear import nvfp4_tile

    w13, w2 = gpu_experts("nvfp4")
    x = tokens(num_tokens, GPU_SHAPE[1], seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, GPU_SHAPE[0], seed=num_tokens, off_rank=True)
    monkeypatch.setattr(nvfp4_tile, "decode", "bits")
    expected = moe_quant_triton(x, w13, w2, weights, ids)
    monkeypatch.setattr(nvfp4_tile, "decode", "asm")
    assert torch.equal(moe_quant_triton(x, w13, w2, weights, ids), expected)
    monkeypatch.setattr(nvfp4_tile, "decode", "auto")
    assert torch.equal(moe_quant_triton(x, w13, w2, weights, ids), expected)


@pytest.mark.parametrize("block_k", [32, 64])
def test_nvfp4_activations_in_halves_give_the_same_bits(block_k: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`a_halves`: x permuted to its even then odd columns, act written so by the gated
    launch, each K step's two halves loaded apart: the same products as the split of a loaded
    tile, so the same bits. I 144 is not a multiple of BLOCK_K 64 (masked K tail); raw bytes
    and off-rank pairs."""
    from moeserve.kernels.moe.quant import fused_triton

    w13, w2 = experts("nvfp4", raw=True, inter=144)
    x = tokens(33, w13.shape[2], seed=3)
    weights, ids = routing(33, w13.shape[0], seed=3, off_rank=True)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                  num_stages=2)
    split = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    monkeypatch.setattr(fused_triton, "a_halves", True)
    halves = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    assert torch.equal(halves, split)
    assert rel_err(halves, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_nvfp4_activations_in_halves_give_the_same_bits(
        num_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`a_halves` on the GPU (bf16, the "asm" decode, the tuned or default tiles): the same
    bits as the split, eager and in a CUDA graph's replay."""
    from moeserve.kernels.moe.quant import fused_triton

    w13, w2 = gpu_experts("nvfp4")
    x = tokens(num_tokens, GPU_SHAPE[1], seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, GPU_SHAPE[0], seed=num_tokens, off_rank=True)
    monkeypatch.setattr(fused_triton, "a_halves", False)
    expected = moe_quant_triton(x, w13, w2, weights, ids)
    monkeypatch.setattr(fused_triton, "a_halves", True)
    assert torch.equal(moe_quant_triton(x, w13, w2, weights, ids), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_quant_triton(x, w13, w2, weights, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected)


def test_nvfp4_asm_decode_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from moeserve.kernels.linear import nvfp4_tile

    w13, w2 = make_weight("nvfp4", 4, 64, 32, None), make_weight("nvfp4", 4, 32, 32, None)
    x = tokens(3, 32, seed=0)
    weights, ids = routing(3, 4, seed=0)
    monkeypatch.setattr(nvfp4_tile, "decode", "asm")
    with pytest.raises(ValueError, match="'asm' needs bf16 activations on CUDA"):
        moe_quant_triton(x, w13, w2, weights, ids)
    monkeypatch.setattr(nvfp4_tile, "decode", "lut")
    with pytest.raises(ValueError, match=r"decode must be one of \('auto', 'bits', 'asm'\)"):
        moe_quant_triton(x, w13, w2, weights, ids)


def test_nvfp4_auto_decode_takes_asm_where_it_runs_and_bits_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve.kernels.linear import nvfp4_tile

    monkeypatch.setattr(nvfp4_tile, "decode", "auto")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert nvfp4_tile.DECODES[nvfp4_tile.decode_id(torch.bfloat16, cuda)] == "asm"
    assert nvfp4_tile.DECODES[nvfp4_tile.decode_id(torch.float16, cuda)] == "bits"
    assert nvfp4_tile.DECODES[nvfp4_tile.decode_id(torch.bfloat16, cpu)] == "bits"
    x = tokens(3, 32, seed=0)  # CPU: the interpreter runs "bits"
    w13, w2 = make_weight("nvfp4", 4, 64, 32, None), make_weight("nvfp4", 4, 32, 32, None)
    weights, ids = routing(3, 4, seed=0)
    got = moe_quant_triton(x, w13, w2, weights, ids)
    monkeypatch.setattr(nvfp4_tile, "decode", "bits")
    assert torch.equal(got, moe_quant_triton(x, w13, w2, weights, ids))
