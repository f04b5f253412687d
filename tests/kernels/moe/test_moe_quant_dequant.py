"""The 4-bit routed experts' large-step path (kernels/moe/quant/dequant.py): every expert
dequantized once, then the bf16 fused MoE. On CPU through Triton's interpreter in fp32 against
moe_quant_ref (random and raw bytes, parts, off-rank ids) and the choice of path; bf16 against
the reference and through moe_quantized on the GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.moe.quant import dequant, moe_quantized
from moeserve.kernels.moe.quant.dequant import (
    DEQUANT_MIN_TOKENS,
    choose_moe_dequant,
    dequant_bytes,
    moe_dequant,
)
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from tests.kernels.moe.test_moe_quant_triton import (
    GPU_SHAPE,
    experts,
    gpu_experts,
    rel_err,
    routing,
    tokens,
)


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_dequant_path_matches_the_reference_fp32(fmt: str, raw: bool) -> None:
    w13, w2 = experts(fmt, raw=raw)
    x = tokens(29, w13.shape[2], seed=3)
    weights, ids = routing(29, w13.shape[0], seed=3, off_rank=True)
    out = moe_dequant(x, w13, w2, weights, ids)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < 1e-5  # fp32: the weights' product order differs, no more
    parts = moe_dequant(x, w13, w2, weights, ids, reduce=False)
    torch.testing.assert_close(parts.sum(1), out, rtol=1e-5, atol=1e-6)
    assert torch.equal(parts[ids == -1], torch.zeros_like(parts[ids == -1]))


def test_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = experts("nvfp4")
    many = DEQUANT_MIN_TOKENS["nvfp4"]
    assert dequant_bytes(w13, w2, torch.bfloat16) == 2 * (w13.shape.numel() + w2.shape.numel())
    cpu = torch.zeros(1, dtype=torch.bfloat16)
    assert not choose_moe_dequant(w13, w2, many, cpu)  # the bf16 MoE: CUDA only

    class CudaLike:  # what the choice reads of x
        is_cuda, dtype = True, torch.bfloat16

    x = CudaLike()
    assert choose_moe_dequant(w13, w2, many, x)
    assert not choose_moe_dequant(w13, w2, many - 1, x)
    fp8_13, fp8_2 = experts("fp8")
    assert not choose_moe_dequant(fp8_13, fp8_2, many, x)  # W8A8: its own MMA
    monkeypatch.setattr(dequant, "DEQUANT_MAX_BYTES", dequant_bytes(w13, w2, x.dtype) - 1)
    assert not choose_moe_dequant(w13, w2, many, x)  # too large a transient
    monkeypatch.undo()
    monkeypatch.setattr(dequant, "mode", "on")
    assert choose_moe_dequant(w13, w2, 1, x)
    monkeypatch.setattr(dequant, "mode", "off")
    assert not choose_moe_dequant(w13, w2, many, x)
    monkeypatch.setattr(dequant, "mode", "auto")
    i13, i2 = experts("int4")  # its own threshold: the fused INT4 tile falls behind sooner
    assert DEQUANT_MIN_TOKENS["int4"] < many
    assert choose_moe_dequant(i13, i2, DEQUANT_MIN_TOKENS["int4"], x)
    assert not choose_moe_dequant(i13, i2, DEQUANT_MIN_TOKENS["int4"] - 1, x)
    monkeypatch.setattr(dequant, "mode", "always")
    with pytest.raises(ValueError, match="mode must be one of"):
        choose_moe_dequant(w13, w2, 1, x)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_gpu_dequant_path_bf16(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = gpu_experts(fmt)
    x = tokens(300, GPU_SHAPE[1], seed=5, dtype=torch.bfloat16)
    weights, ids = routing(300, GPU_SHAPE[0], seed=5, off_rank=True)
    ref = moe_quant_ref(x, w13, w2, weights, ids)
    monkeypatch.setattr(dequant, "mode", "on")
    out = moe_quantized(x, w13, w2, weights, ids)  # the engine's entry takes the path
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2
    assert torch.equal(out, moe_dequant(x, w13, w2, weights, ids))
    monkeypatch.setattr(dequant, "mode", "off")
    fused = moe_quantized(x, w13, w2, weights, ids)
    assert rel_err(out, fused) < 2e-2
