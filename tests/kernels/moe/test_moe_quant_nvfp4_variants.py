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


def test_the_mma_layout_puts_a_lanes_fragment_bytes_together_and_back() -> None:
    """nvfp4_regs' mma layout: in each 64-byte micro-tile row, lane c's bytes of every 32-k
    span (16 s + 4 b + c, b = 0..3: k = 2c, 2c + 1, 2c + 8, 2c + 9 of the span's first 16 and
    the same of its second) are its 16 contiguous bytes 16 c + 4 s + b; the inverse gives the
    micro-tiles back; anything but uint8 rows of whole 64-byte tiles is refused."""
    from moeserve.kernels.moe.quant.nvfp4_regs import from_mma_words, to_mma_words

    q = torch.arange(2 * 16 * 128, dtype=torch.int32).remainder(251).to(torch.uint8)
    q = q.reshape(2, 16, 128)
    m = to_mma_words(q)
    assert m.shape == q.shape and torch.equal(from_mma_words(m), q)
    for row, tile in ((0, 0), (5, 1)):
        old = q[1, row, 64 * tile:64 * tile + 64]
        new = m[1, row, 64 * tile:64 * tile + 64]
        for c in range(4):
            for s in range(4):
                for b in range(4):
                    assert new[16 * c + 4 * s + b] == old[16 * s + 4 * b + c]
    with pytest.raises(ValueError, match="micro-tiled uint8 bytes"):
        to_mma_words(q[..., :96])


def test_mma_layout_weights_are_refused_where_its_kernel_does_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights in the mma layout read wrong through any other kernel: the op refuses them
    by name where nvfp4_regs' kernel does not take the launch (here: the CPU), and only
    micro-tiled NVFP4 weights convert."""
    from moeserve.kernels.moe.quant import nvfp4_regs
    from moeserve.kernels.moe.quant.micro_tiles import tile_in_place

    w13, w2 = make_weight("nvfp4", 4, 256, 128, None), make_weight("nvfp4", 4, 128, 128, None)
    with pytest.raises(ValueError, match="micro-tiled NVFP4"):
        nvfp4_regs.mma_words_in_place(w13)  # rows
    for w in (w13, w2):
        tile_in_place(w)
        nvfp4_regs.mma_words_in_place(w)
    x = tokens(3, 128, seed=0)
    weights, ids = routing(3, 4, seed=0)
    monkeypatch.setattr(nvfp4_regs, "enabled", True)
    with pytest.raises(ValueError, match="mma layout run through its kernel only"):
        moe_quant_triton(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="micro-tiled NVFP4"):
        nvfp4_regs.mma_words_in_place(make_weight("int4", 4, 256, 128, 32))


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "block_t"), [(5, 16), (300, 32), (700, 64),
                                                     (700, 16)])
def test_gpu_nvfp4_regs_matches_the_triton_tile(num_tokens: int, block_t: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """moe/quant/nvfp4_regs.py (the decoded weights as wgmma's A in registers, in Gluon,
    over the mma layout): the same decoded weights and products as the Triton tile over the
    micro-tiles, so the same output but for the order of the fp32 sums (a bf16 ulp or so,
    through both launches), eager and replayed in a CUDA graph; pairs of other ranks' experts
    (-1) give zero rows either way."""
    from moeserve.kernels.moe.quant import nvfp4_regs
    from moeserve.kernels.moe.quant.micro_tiles import tile_in_place

    config = {"BLOCK_M": block_t, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
              "num_warps": 4, "num_stages": 3}
    w13, w2 = gpu_experts("nvfp4")
    for w in (w13, w2):
        tile_in_place(w)
    x = tokens(num_tokens, GPU_SHAPE[1], seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, GPU_SHAPE[0], seed=num_tokens, off_rank=True)
    expected = moe_quant_triton(x, w13, w2, weights, ids, config=config, reduce=False)
    for w in (w13, w2):
        nvfp4_regs.mma_words_in_place(w)
    monkeypatch.setattr(nvfp4_regs, "enabled", True)
    assert nvfp4_regs.takes(x, w13, config, True) and nvfp4_regs.takes(x, w2, config, False)
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
