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


# ---------------------------------------------------------------- the swapped tile

def _swapped_and_not(x, w13, w2, weights, ids, config, monkeypatch, **kw):
    from moeserve.kernels.moe.quant import fused_triton

    monkeypatch.setattr(fused_triton, "swap_ab", False)
    plain = moe_quant_triton(x, w13, w2, weights, ids, config=config, **kw)
    monkeypatch.setattr(fused_triton, "swap_ab", True)
    return moe_quant_triton(x, w13, w2, weights, ids, config=config, **kw), plain


@pytest.mark.parametrize(("block_k", "num_tokens"), [(32, 1), (64, 9), (128, 33)])
def test_nvfp4_swapped_tile_matches(block_k: int, num_tokens: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """swapped_triton's transposed tile (BLOCK_N 64, several row blocks, off-rank pairs):
    the unswapped tile's sums up to their order, and the reference's."""
    from moeserve.kernels.moe.quant.ref import moe_quant_ref
    from tests.kernels.moe.test_moe_quant_triton import experts, rel_err

    w13, w2 = experts("nvfp4", inter=64)  # N 128 and 256: two and four tiles of 64 rows
    x = tokens(num_tokens, w13.shape[2], seed=num_tokens)
    weights, ids = routing(num_tokens, w13.shape[0], seed=num_tokens, off_rank=True)
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=2, num_warps=4,
                  num_stages=2)
    swapped, plain = _swapped_and_not(x, w13, w2, weights, ids, config, monkeypatch)
    assert rel_err(swapped, plain) < 1e-5
    assert rel_err(swapped, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-4
    parts, _ = _swapped_and_not(x, w13, w2, weights, ids, config, monkeypatch, reduce=False)
    assert torch.equal(parts[ids == -1], torch.zeros_like(parts[ids == -1]))


def test_nvfp4_swapped_tile_with_a_partial_k_step_and_raw_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every nibble and e4m3 code (raw bytes), a K of 80 (BLOCK_K 32: a partial last step), a
    weight row count that is not a multiple of 64 (a masked N tail)."""
    w13 = make_weight("nvfp4", 4, 2 * 48, 80, None, raw=True, seed=3)
    w2 = make_weight("nvfp4", 4, 80, 48, None, raw=True, seed=4)
    x = tokens(21, 80, seed=5)
    weights, ids = routing(21, 4, seed=5)
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    swapped, plain = _swapped_and_not(x, w13, w2, weights, ids, config, monkeypatch)
    from tests.kernels.moe.test_moe_quant_triton import rel_err

    assert not swapped.isnan().any()
    assert rel_err(swapped, plain) < 1e-5


def test_nvfp4_narrow_tiles_are_not_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """BLOCK_N below wgmma's 64 rows keeps the plain tile: the same bits with the switch."""
    w13, w2 = make_weight("nvfp4", 4, 64, 32, None), make_weight("nvfp4", 4, 32, 32, None)
    x = tokens(5, 32, seed=0)
    weights, ids = routing(5, 4, seed=0)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)
    swapped, plain = _swapped_and_not(x, w13, w2, weights, ids, config, monkeypatch)
    assert torch.equal(swapped, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300, 1024])
def test_gpu_nvfp4_swapped_tile_matches(num_tokens: int, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """bf16 on the GPU ("asm" decode), at the tuned / default tiles widened to 64 rows and at
    128: the plain tile's result within bf16's rounding of a different summation order."""
    from moeserve.kernels.moe.quant.configs import get_quant_config
    from tests.kernels.moe.test_moe_quant_triton import rel_err

    w13, w2 = gpu_experts("nvfp4")
    x = tokens(num_tokens, GPU_SHAPE[1], seed=num_tokens, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, GPU_SHAPE[0], seed=num_tokens, off_rank=True)
    found = get_quant_config("nvfp4", GPU_SHAPE[0], GPU_SHAPE[1], GPU_SHAPE[2], 2, 16,
                             torch.bfloat16, num_tokens * 2 // GPU_SHAPE[0] or 1, "H200",
                             tiles="default").config
    for block_n, warps in ((64, 4), (128, 8)):
        config = {**found, "BLOCK_N": block_n, "num_warps": warps}
        swapped, plain = _swapped_and_not(x, w13, w2, weights, ids, config, monkeypatch)
        assert rel_err(swapped, plain) < 1e-2, config
