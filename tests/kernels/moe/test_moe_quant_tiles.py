"""The quantized fused MoE's tiles and launch options against the reference (Triton's
interpreter, fp32, small shapes): explicit tiles, SUB_M's half and quarter tiles, the down
launch's own tiles ("down"), the 4-bit 256-K step, K-major group scales. Shapes and helpers are
test_moe_quant_triton.py's."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant.configs import WIDE_K_MIN, default_quant_config
from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.kernels.moe.launch_spy import spy_launches
from tests.kernels.moe.test_moe_quant_triton import (
    DEVICE,
    SHAPES,
    TOP_K,
    W4A16,
    assert_tiles_match_ref,
    experts,
    rel_err,
    routing,
    tokens,
)


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_explicit_tiles_fp32(fmt: str) -> None:
    """Other tiles: GROUP_M > 1 orders several row blocks per N-tile, BLOCK_N 32 several
    N-tiles, BLOCK_K the group (int4: 32, a K loop of 7 steps with a partial last group)."""
    block_k = {"fp8": 128, "nvfp4": 32, "int4": 32}[fmt]
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=3, num_warps=4,
                  num_stages=2)
    assert_tiles_match_ref(fmt, config, 33, seed=4)


def skewed_routing(num_tokens: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing (k = 2) whose experts hold 56, 24 and 10 pairs, the rest spread over the others:
    the pairs' experts in runs, token t taking runs' positions t and T + t (distinct, as no
    expert holds more than T pairs)."""
    rest = 2 * num_tokens - 90
    counts = [56, 24, 10] + [rest // (num_experts - 3) + (e < rest % (num_experts - 3))
                             for e in range(num_experts - 3)]
    runs = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts))
    ids = torch.stack([runs[:num_tokens], runs[num_tokens:]], dim=1).int()
    weights = torch.rand(num_tokens, TOP_K, generator=torch.Generator().manual_seed(7))
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_sub_m_tiles_give_the_whole_blocks_bits(fmt: str) -> None:
    """SUB_M: a 64-row block whose real rows fit 32 (16) computes a tile of that height (the
    routing has blocks of all three); the rows' results are those of the whole blocks."""
    w13, w2 = experts(fmt)
    x = tokens(60, w13.shape[2], seed=8)
    weights, ids = skewed_routing(60, w13.shape[0])
    assert (ids[:, 0] != ids[:, 1]).all()
    block_k = {"fp8": 128, "nvfp4": 64, "int4": 32}[fmt]
    config = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4, num_stages=2)
    whole = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    out = moe_quant_triton(x, w13, w2, weights, ids, config=config | {"SUB_M": 1})
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 1e-4
    assert rel_err(out, whole) < 1e-6  # each row its own sums (their order may differ)


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_the_down_launch_takes_its_own_tiles(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config's "down" entry: the down launch's BLOCK_N, BLOCK_K, GROUP_M, warps and stages
    (BLOCK_M shared), the gated launch the top-level ones; the result the reference's."""
    from moeserve.kernels.moe.quant import fused_triton

    block_k = {"fp8": 128, "nvfp4": 32, "int4": 32}[fmt]
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                  num_stages=2, down=dict(BLOCK_N=64, BLOCK_K=128 if fmt != "int4" else 64,
                                          GROUP_M=2, num_warps=4, num_stages=3))
    launched = spy_launches(monkeypatch, fused_triton, 11)
    assert_tiles_match_ref(fmt, config, 33, seed=9)
    assert launched[0] == config  # the gated launch: the top-level tiles
    assert launched[1] == {"BLOCK_M": 16} | config["down"]


@pytest.mark.parametrize("fmt", W4A16)
def test_wide_k_tiles_fp32(fmt: str) -> None:
    """The 4-bit formats' 256-K step (configs.WIDE_K): the gated launch's K 256 one whole
    step, the down launch's K 128 / 200 one partial step (int4: a partial last group too)."""
    config = default_quant_config(fmt, 1, TOP_K, 8, 16 if fmt == "nvfp4" else 32,
                                  (WIDE_K_MIN, WIDE_K_MIN))
    assert config["BLOCK_K"] == 256
    assert_tiles_match_ref(fmt, config, 7, seed=5)


@pytest.mark.parametrize("fmt", W4A16)
def test_k_major_scales_give_the_same_bits(fmt: str) -> None:
    """The group scales stored N-fastest (kernels_quant's --scale-layout k-major: the same
    [E, N, K / G] view, other strides) are read by their strides: the same output."""
    w13, w2 = experts(fmt)
    x = tokens(7, w13.shape[2], seed=8)
    weights, ids = routing(7, w13.shape[0], seed=8)
    rows = moe_quant_triton(x, w13, w2, weights, ids)
    for w in (w13, w2):
        w.scale.data = w.scale.data.mT.contiguous().mT
        assert w.scale.stride(-2) == 1
    assert torch.equal(moe_quant_triton(x, w13, w2, weights, ids), rows)
