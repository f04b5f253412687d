"""The NVFP4 fused MoE's nibble decodes give the same bits: the inline-PTX "asm" decode against
"bits", and where each runs. Helpers and shapes are test_moe_quant_triton.py's."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from tests.kernels.moe.test_moe_quant_triton import (
    GPU_SHAPE,
    gpu_experts,
    make_weight,
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


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "block_t", "block_k", "micro"),
                         [(5, 16, 64, True), (300, 32, 64, True), (300, 64, 64, False),
                          (700, 32, 128, True), (700, 16, 128, False)])
def test_gpu_nvfp4_swapped_matches_the_triton_tile(num_tokens: int, block_t: int,
                                                   block_k: int, micro: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """moe/quant/nvfp4_swapped.py (MOESERVE_NVFP4_SWAPPED=1: the tokens as wgmma's N, in
    Gluon): the same decoded weights and products as the Triton tile, so the same output but
    for the order of the fp32 sums (a bf16 ulp or so, through both launches), on both weight
    layouts, eager and replayed in a CUDA graph; pairs of other ranks' experts (-1) give zero
    rows either way."""
    from moeserve.kernels.moe.quant import nvfp4_swapped
    from moeserve.kernels.moe.quant.micro_tiles import tile_in_place

    config = {"BLOCK_M": block_t, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
              "num_warps": 4, "num_stages": 3}
    w13, w2 = gpu_experts("nvfp4")
    if micro:
        tile_in_place(w13)
        tile_in_place(w2)
    x = tokens(num_tokens, GPU_SHAPE[1], seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, GPU_SHAPE[0], seed=num_tokens, off_rank=True)
    monkeypatch.setattr(nvfp4_swapped, "enabled", False)
    expected = moe_quant_triton(x, w13, w2, weights, ids, config=config, reduce=False)
    monkeypatch.setattr(nvfp4_swapped, "enabled", True)
    monkeypatch.setattr(nvfp4_swapped, "BLOCK_K", block_k)
    assert nvfp4_swapped.takes(x, w13, config, True) and nvfp4_swapped.takes(x, w2, config,
                                                                              False)
    got = moe_quant_triton(x, w13, w2, weights, ids, config=config, reduce=False)
    scale = expected.float().abs().max()
    assert got.isfinite().all() and scale > 0
    assert (got.float() - expected.float()).abs().max() <= 2e-2 * scale
    assert torch.equal(got[ids < 0], torch.zeros_like(got[ids < 0]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_quant_triton(x, w13, w2, weights, ids, config=config, reduce=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)


def test_nvfp4_swapped_takes_nothing_off_the_gpu_or_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The experiment runs only when switched on, for NVFP4 under bf16 on an sm90 GPU and
    row blocks of 16-64: on the CPU (and by default) the Triton tile runs, to its bits."""
    from moeserve.kernels.moe.quant import nvfp4_swapped

    config = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
              "num_stages": 3}
    w13, w2 = make_weight("nvfp4", 4, 256, 128, None), make_weight("nvfp4", 4, 128, 128, None)
    x = tokens(3, 128, seed=0)
    weights, ids = routing(3, 4, seed=0)
    assert not nvfp4_swapped.enabled  # MOESERVE_NVFP4_SWAPPED unset
    expected = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    monkeypatch.setattr(nvfp4_swapped, "enabled", True)
    assert not nvfp4_swapped.takes(x.bfloat16(), w13, config, True)  # the CPU
    assert torch.equal(moe_quant_triton(x, w13, w2, weights, ids, config=config), expected)
    for fmt in ("int4", "fp8"):
        assert not nvfp4_swapped.takes(x, make_weight(fmt, 4, 256, 128, 32 if fmt == "int4"
                                                      else None), config, True)
