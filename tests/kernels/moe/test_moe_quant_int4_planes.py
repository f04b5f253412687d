"""The INT4 fused MoE's nibble-plane decode (linear/int4_tile.py, fused_triton's DECODE 1 for
int4) against the reference and against the reshape decode (DECODE 0): the same dequantized
weights, so the two differ only by the dots' summation order. On the CPU through Triton's
interpreter in fp32; on the GPU (marked) in bf16 too, with the PTX decode ("planes-asm";
tests/kernels/linear/test_int4_asm_emulated.py runs its PTX on the CPU)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.linear import int4_tile
from moeserve.kernels.moe.quant.fused_triton import moe_quant_triton
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.kernels.moe.test_moe_quant_triton import (
    SHAPES,
    make_weight,
    rel_err,
    routing,
    tokens,
)


def _config(block_k: int) -> dict[str, int]:
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                num_stages=2)


def _experts(group: int, inter: int, dtype: torch.dtype = torch.float32):
    e, h, _, _ = SHAPES["int4"]
    return (make_weight("int4", e, 2 * inter, h, group, raw=True, dtype=dtype, seed=1),
            make_weight("int4", e, h, inter, group, raw=True, dtype=dtype, seed=2))


@pytest.mark.parametrize(("group", "inter", "block_k"),
                         [(32, 200, 128), (32, 196, 128), (128, 200, 128), (32, 200, 256)])
def test_planes_match_the_reference_and_the_reshape_decode(
        monkeypatch: pytest.MonkeyPatch, group: int, inter: int, block_k: int) -> None:
    """Groups of 4 and 16 words, w2's K of 200 (a partial last K step) and 196 (a partial
    last word), BLOCK_K 128 and 256 (H 256: one step)."""
    w13, w2 = _experts(group, inter)
    x = tokens(33, w13.shape[2], seed=7)
    weights, ids = routing(33, w13.shape[0], seed=7)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    monkeypatch.setattr(int4_tile, "decode", "planes")
    planes = moe_quant_triton(x, w13, w2, weights, ids, config=_config(block_k))
    monkeypatch.setattr(int4_tile, "decode", "reshape")
    reshape = moe_quant_triton(x, w13, w2, weights, ids, config=_config(block_k))
    assert rel_err(planes, ref) < 1e-4
    assert rel_err(planes, reshape) < 1e-5  # the same weights, another summation order
    assert not torch.equal(planes, reshape)  # (so the planes ran: ~90% of the bits differ)
    assert not torch.equal(planes, torch.zeros_like(planes))


def test_the_planes_decode_asked_for_at_a_small_block_k_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = _experts(32, 200)
    x = tokens(3, w13.shape[2], seed=8)
    weights, ids = routing(3, w13.shape[0], seed=8)
    monkeypatch.setattr(int4_tile, "decode", "planes")
    with pytest.raises(ValueError, match="int4 decode 'planes' needs BLOCK_K"):
        moe_quant_triton(x, w13, w2, weights, ids, config=_config(64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_planes_in_bf16(monkeypatch: pytest.MonkeyPatch, num_tokens: int) -> None:
    """bf16 activations and scales on the GPU, the decode tile of 16 and of 64 rows: the planes
    against the reference and the reshape decode (the same bf16 weights; fp32 sums in another
    order), the PTX planes bit for bit the Triton ones."""
    w13, w2 = _experts(32, 200, torch.bfloat16)
    x = tokens(num_tokens, w13.shape[2], seed=9, dtype=torch.bfloat16)
    weights, ids = routing(num_tokens, w13.shape[0], seed=9)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    for block_m in (16, 64):
        config = _config(128) | {"BLOCK_M": block_m, "BLOCK_N": 64, "num_stages": 3}
        out = {}
        for decode in int4_tile.DECODES:
            monkeypatch.setattr(int4_tile, "decode", decode)
            out[decode] = moe_quant_triton(x, w13, w2, weights, ids, config=config)
        assert rel_err(out["planes"], ref) < 2e-2, block_m
        assert rel_err(out["planes"], out["reshape"]) < 1e-2, block_m
        # the same bf16 weights and the same dots: the PTX decode gives the planes' bits
        assert torch.equal(out["planes-asm"], out["planes"]), block_m
