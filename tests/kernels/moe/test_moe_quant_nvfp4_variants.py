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
@pytest.mark.parametrize(("num_tokens", "block_m"), [(300, 64), (700, 64), (700, 128)])
def test_gpu_nvfp4_gluon_tiles_match_the_triton_tiles(num_tokens: int, block_m: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """moe/quant/nvfp4_gluon.py (MOESERVE_NVFP4_GLUON=1: the 64- and 128-row tiles in Gluon, the
    decode beside the previous step's wgmmas): the same decoded weights and products as the
    Triton tile, so the same output but for the order of the fp32 sums (a bf16 ulp or so,
    through both launches), eager and replayed in a CUDA graph; pairs of other ranks' experts
    (-1) give zero rows either way."""
    from moeserve.kernels.moe.quant import nvfp4_gluon

    config = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
              "num_warps": block_m // 16, "num_stages": 3}
    w13, w2 = gpu_experts("nvfp4")
    x = tokens(num_tokens, GPU_SHAPE[1], seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, GPU_SHAPE[0], seed=num_tokens, off_rank=True)
    monkeypatch.setattr(nvfp4_gluon, "enabled", False)
    expected = moe_quant_triton(x, w13, w2, weights, ids, config=config, reduce=False)
    monkeypatch.setattr(nvfp4_gluon, "enabled", True)
    assert nvfp4_gluon.takes(x, config, GPU_SHAPE[2], GPU_SHAPE[1], 16, True)
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


def test_nvfp4_gluon_takes_nothing_off_the_gpu_or_switched_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The experiment runs only when switched on, for bf16 on an sm90 GPU and 64- or 128-row blocks:
    on the CPU (and by default) the Triton tile runs."""
    from moeserve.kernels.moe.quant import nvfp4_gluon

    config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
              "num_stages": 3}
    x = torch.zeros(4, 1024, dtype=torch.bfloat16)
    assert not nvfp4_gluon.enabled  # MOESERVE_NVFP4_GLUON unset
    monkeypatch.setattr(nvfp4_gluon, "enabled", True)
    assert not nvfp4_gluon.takes(x, config, 512, 1024, 16, True)  # the CPU
