"""The quantized fused MoE on the GPU in bf16 (test_moe_quant_triton.py's formats at a larger
shape, GPU_SHAPE): against the reference at several token counts and at the wide K step, no
host sync, a CUDA-graph replay with new routing."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant.configs import WIDE_K_MIN, default_quant_config
from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.cuda_graph import capture
from tests.kernels.moe.test_moe_quant_triton import (
    GPU_FORMATS,
    GPU_SHAPE,
    TOP_K,
    W4A16,
    gpu_experts,
    rel_err,
    routing,
    tokens,
)


def gpu_case(fmt: str, num_tokens: int, seed: int, off_rank: bool = False) -> tuple:
    """(w13, w2, x, weights, ids): GPU_SHAPE's experts in `fmt`, bf16 tokens and routing."""
    w13, w2 = gpu_experts(fmt)
    x = tokens(num_tokens, GPU_SHAPE[1], seed=seed, dtype=torch.bfloat16)
    return (w13, w2, x, *routing(num_tokens, GPU_SHAPE[0], seed=seed, off_rank=off_rank))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("fmt", list(GPU_FORMATS))
def test_gpu_bf16_matches_ref(fmt: str, num_tokens: int) -> None:
    w13, w2, x, weights, ids = gpu_case(fmt, num_tokens, num_tokens, off_rank=True)
    out = moe_quant_triton(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 2e-2
    parts = moe_quant_triton(x, w13, w2, weights, ids, reduce=False)
    assert torch.equal(parts.sum(1), out)
    assert torch.equal(parts[ids == -1], torch.zeros_like(parts[ids == -1]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", W4A16)
def test_gpu_wide_k_tile_matches_ref(fmt: str) -> None:
    """The 256-K decode tile in bf16 (its PTX decodes at twice the 128-K step's registers)."""
    config = default_quant_config(fmt, 64, TOP_K, GPU_SHAPE[0], GPU_FORMATS[fmt] or 16,
                                  (WIDE_K_MIN, WIDE_K_MIN))  # the tile of GLM-5's experts
    assert config["BLOCK_K"] == 256
    w13, w2, x, weights, ids = gpu_case(fmt, 64, 6)
    out = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    assert rel_err(out, moe_quant_ref(x, w13, w2, weights, ids)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(GPU_FORMATS))
def test_gpu_no_host_sync(fmt: str) -> None:
    w13, w2, x, weights, ids = gpu_case(fmt, 64, 1)
    moe_quant_triton(x, w13, w2, weights, ids)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_quant_triton(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(GPU_FORMATS))
def test_gpu_cuda_graph_replays_with_new_routing(fmt: str) -> None:
    w13, w2, x, weights, ids = gpu_case(fmt, 96, 2)
    static = [x.clone(), weights.clone(), ids.clone()]

    def step() -> torch.Tensor:
        return moe_quant_triton(static[0], w13, w2, static[1], static[2])

    graph, static_out = capture(step)
    x2 = tokens(96, GPU_SHAPE[1], seed=3, dtype=torch.bfloat16)
    weights2, ids2 = routing(96, GPU_SHAPE[0], seed=3, off_rank=True)  # new routing
    for buf, new in zip(static, (x2, weights2, ids2)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(static_out, step())  # deterministic: the same bits as eager
    assert rel_err(static_out, moe_quant_ref(x2, w13, w2, weights2, ids2)) < 2e-2
