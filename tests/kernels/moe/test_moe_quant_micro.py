"""The 4-bit experts' micro-tiled layout (kernels/moe/quant/micro_tiles.py): the permutation and
its inverse, the fused kernel reading it (Triton's interpreter on CPU, the GPU when marked)
with the row layout's bits, and the paths that read only the row layout refusing it."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.micro_tiles import from_micro, micro_arg, to_micro
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.kernels.moe.test_moe_quant_triton import (
    DEVICE,
    GPU_SHAPE,
    experts,
    gpu_experts,
    routing,
    tokens,
)


def assert_micro_gives_the_bits(w13, w2, x, weights, ids, config: dict) -> None:
    """The op's output with both weights micro-tiled equals the row layout's, bit for bit."""
    rows = moe_quant_triton(x, w13, w2, weights, ids, config=config)
    for w in (w13, w2):
        w.qweight.data = to_micro(w.qweight.data)
        w.micro_tiled = True
    assert torch.equal(moe_quant_triton(x, w13, w2, weights, ids, config=config), rows)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_the_layout_is_16_rows_by_64_bytes_and_its_inverse(dtype: torch.dtype) -> None:
    mc = 64 // torch.empty((), dtype=dtype).element_size()
    q = torch.arange(2 * 32 * 2 * mc, dtype=torch.int64).to(dtype).reshape(2, 32, 2 * mc)
    m = to_micro(q)
    assert m.shape == q.shape and torch.equal(from_micro(m), q)
    flat = m.reshape(-1)
    # expert 0: rows 0-15 of column block 0, then rows 0-15 of block 1, then rows 16-31
    assert torch.equal(flat[:16 * mc], q[0, :16, :mc].reshape(-1))
    assert torch.equal(flat[16 * mc:32 * mc], q[0, :16, mc:].reshape(-1))
    assert torch.equal(flat[32 * mc:48 * mc], q[0, 16:, :mc].reshape(-1))
    with pytest.raises(ValueError, match=r"rows a multiple of 16 .*got \[2, 24, "):
        to_micro(q[:, :24])
    with pytest.raises(ValueError, match="packed columns a multiple"):
        to_micro(q[..., :mc + 1])


@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_the_kernel_reads_micro_tiles_to_the_same_bits(fmt: str, block_k: int) -> None:
    w13, w2 = experts(fmt, inter=128)  # int4's own I 200 is not a whole tile row
    x = tokens(7, w13.shape[2], seed=9)
    weights, ids = routing(7, w13.shape[0], seed=9)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                  num_stages=2)
    assert_micro_gives_the_bits(w13, w2, x, weights, ids, config)
    with pytest.raises(ValueError, match="w13 is micro-tiled"):
        moe_quant_ref(x, w13, w2, weights, ids)


def test_micro_tiles_are_4_bit_only() -> None:
    w13, _ = experts("fp8")
    w13.micro_tiled = True
    with pytest.raises(ValueError, match="NVFP4 / INT4 only, got fp8"):
        micro_arg("fp8", w13, w13.qweight)
    assert micro_arg("nvfp4", experts("nvfp4")[0], torch.empty(0, dtype=torch.uint8)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_gpu_micro_tiles_give_the_same_bits(fmt: str, block_k: int) -> None:
    assert DEVICE == "cuda" and GPU_SHAPE[1] % 128 == 0 and GPU_SHAPE[2] % 128 == 0
    w13, w2 = gpu_experts(fmt)
    x = tokens(64, GPU_SHAPE[1], seed=10, dtype=torch.bfloat16)
    weights, ids = routing(64, GPU_SHAPE[0], seed=10)
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                  num_stages=3)
    assert_micro_gives_the_bits(w13, w2, x, weights, ids, config)
