"""The 4-bit experts' micro-tiled layout (kernels/moe/quant/micro_tiles.py): the permutation and
its inverse, the fused kernel reading it (Triton's interpreter on CPU, the GPU when marked)
with the row layout's bits, the dequantize-first path reading it back to rows, the in-place
tiling the engine does at start-up (layers/moe.py's tile_experts) and the paths that read only
the row layout refusing it."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import ConfigError
from moeserve.kernels.moe.quant.configs import default_quant_config
from moeserve.kernels.moe.quant.dequant import moe_dequant
from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.micro_tiles import (
    fits_shape,
    from_micro,
    is_micro,
    micro_arg,
    micro_unfit,
    tile_in_place,
    to_micro,
)
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.kernels.moe.test_moe_quant_triton import (
    DEVICE,
    GPU_SHAPE,
    experts,
    gpu_experts,
    make_weight,
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


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_tiling_in_place_is_to_micro_and_drops_row_views(fmt: str) -> None:
    w13, w2 = experts(fmt, inter=128)
    rows = w13.qweight.detach().clone()
    assert micro_unfit(w13) == "" and not is_micro(w13)
    tile_in_place(w13)
    assert is_micro(w13) and torch.equal(w13.qweight, to_micro(rows))
    tile_in_place(w13)  # once only: a second call leaves it as it is
    assert torch.equal(from_micro(w13.qweight), rows)
    with pytest.raises(ValueError, match="micro-tiled QuantWeight has no row views"):
        w13[0]
    w13_odd, w2_odd = experts(fmt, inter=192)  # w2's K (the width): not whole 128-K tile rows
    assert "needs rows a multiple of 16 and K a multiple of 128" in micro_unfit(w2_odd)
    with pytest.raises(ValueError, match="cannot micro-tile: .*K a multiple of 128"):
        tile_in_place(w2_odd)
    assert micro_unfit(w13_odd) == ""  # w13's K is the hidden size, 256
    fp8, _ = experts("fp8")
    assert micro_unfit(fp8) == "fp8 weights are not packed 4-bit"


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_the_dequantize_first_path_reads_micro_tiles_back(fmt: str) -> None:
    w13, w2 = experts(fmt, inter=128)
    x = tokens(9, w13.shape[2], seed=4)
    weights, ids = routing(9, w13.shape[0], seed=4)
    rows = moe_dequant(x, w13, w2, weights, ids)
    tile_in_place(w13)
    tile_in_place(w2)
    assert torch.equal(moe_dequant(x, w13, w2, weights, ids), rows)


@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", 16), ("int4", 32)])
def test_the_dequantize_kernel_reads_micro_tiles_to_the_rows_bits(fmt: str, group: int) -> None:
    """The dequantize kernel over micro-tiles (NVFP4's bytes read there as int32 words, 8 k a
    word) gives the row layout's weights bit for bit: random bytes (every nibble code, both
    signs of zero), NVFP4 with its global scale, K of two steps."""
    assert_dequant_micro_bits(fmt, group)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", 16), ("int4", 32)])
def test_gpu_the_dequantize_kernel_reads_micro_tiles_to_the_rows_bits(fmt: str,
                                                                      group: int) -> None:
    assert DEVICE == "cuda"
    assert_dequant_micro_bits(fmt, group)


def assert_dequant_micro_bits(fmt: str, group: int) -> None:
    from moeserve.kernels.linear.w4a16_dequant import dequantize_w4a16
    from moeserve.kernels.moe.quant.micro_tiles import micro_columns

    e, n, k = 2, 32, 256
    w = make_weight(fmt, e, n, k, group if fmt == "int4" else None, raw=True)
    glob = w.global_scale if fmt == "nvfp4" else None
    for dtype in (torch.float32, torch.bfloat16):  # on CUDA: the float8 scale loads, bf16 out
        rows = dequantize_w4a16(fmt, w.qweight, w.scale, group, k, dtype, glob)
        micro = dequantize_w4a16(fmt, to_micro(w.qweight), w.scale, group, k, dtype, glob,
                                 micro=micro_columns(w.qweight.dtype))
        assert rows.isfinite().all() and torch.equal(rows, micro)


def test_micro_tiles_keep_128_k_steps_and_the_engine_tiles_4_bit_multiples_of_128() -> None:
    glm5 = (6144, 2048)  # (H, I): the 4-bit decode default's 256-K step, not for micro-tiles
    assert default_quant_config("nvfp4", 64, 8, 256, 16, glm5)["BLOCK_K"] == 256
    assert default_quant_config("nvfp4", 64, 8, 256, 16, glm5, micro=True)["BLOCK_K"] == 128
    assert default_quant_config("int4", 64, 8, 256, 32, glm5, micro=True)["BLOCK_K"] == 128
    assert fits_shape("nvfp4", *glm5) and fits_shape("int4", 2048, 768)
    assert not fits_shape("fp8", *glm5) and not fits_shape("nvfp4", 2048, 704)


def test_the_engine_tiles_its_4_bit_experts_where_it_can() -> None:
    from moeserve.layers.moe import tile_experts

    class Block:  # what tile_experts reads of a SparseMoeBlock
        def __init__(self, fmt: str, inter: int = 128) -> None:
            self.w13, self.w2 = experts(fmt, inter=inter)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # the decision; the tensors on CPU
    blocks = [Block("nvfp4"), Block("nvfp4")]
    line = tile_experts(blocks, "auto", cuda)
    assert line == "nvfp4 experts micro-tiled (16 rows x 64 bytes; moe_weight_layout auto)"
    assert all(is_micro(w) for b in blocks for w in (b.w13, b.w2))
    line = tile_experts([Block("int4")], "rows", cuda)
    assert line == "int4 experts in rows (moe_weight_layout rows)"
    line = tile_experts(rows := [Block("int4")], "auto", cpu)
    assert line.startswith("int4 experts in rows: the fused MoE reads micro-tiles on CUDA only")
    assert not is_micro(rows[0].w13)
    with pytest.raises(ConfigError, match="moe_weight_layout micro: the fused MoE reads"):
        tile_experts([Block("int4")], "micro", cpu)
    odd = [Block("nvfp4", inter=192)]
    assert "K a multiple of 128" in tile_experts(odd, "auto", cuda)
    assert not is_micro(odd[0].w13)  # all or none: the block's w13 fit, its w2 not
    with pytest.raises(ConfigError, match="micro needs NVFP4 or INT4 routed experts; this "
                                          "model's are fp8"):
        tile_experts([Block("fp8")], "micro", cuda)
    assert tile_experts([Block("fp8")], "auto", cuda) == ""


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
