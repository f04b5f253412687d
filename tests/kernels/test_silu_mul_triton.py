"""SwiGLU's silu(gate) * up in one Triton launch (kernels/activation/silu_mul_triton.py)
against Hugging Face's two ops: CPU under Triton's interpreter (fp32, fp16; numpy's exp there,
so within an ulp) and the GPU (bf16, fp16, fp32: bit for bit)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.activation.silu_mul_triton import silu_mul_ref, silu_mul_triton
from moeserve.layers import mlp as mlp_module
from moeserve.layers.mlp import MLP


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "inter"), [(5, 48), (3, 1536), (1, 7)])
def test_matches_the_two_ops(dtype: torch.dtype, rows: int, inter: int) -> None:
    x = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    got = silu_mul_triton(x)
    want = silu_mul_ref(x)
    assert got.dtype == dtype and got.shape == (rows, inter) and got.is_contiguous()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps)


def test_a_strided_row_view_and_no_rows() -> None:
    wide = torch.randn(4, 100)
    x = wide[:, 2:98]  # [4, 96], row stride 100
    torch.testing.assert_close(silu_mul_triton(x), silu_mul_ref(x), rtol=1e-6, atol=1e-6)
    assert silu_mul_triton(torch.empty(0, 8)).shape == (0, 4)


@pytest.mark.parametrize(("x", "message"), [
    (torch.randn(4, 7), "must be \\[T, 2I\\]"),
    (torch.randn(4, 8).t(), "must be \\[T, 2I\\]"),
    (torch.randn(2, 4, 8), "must be \\[T, 2I\\]"),
    (torch.ones(4, 8, dtype=torch.int32), "fp32, fp16 or bf16")])
def test_bad_input_is_named(x: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        silu_mul_triton(x)


def test_mlp_takes_it_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the MLP runs Hugging Face's ops (the exact fp32 reference path)."""
    calls: list[int] = []
    monkeypatch.setattr(mlp_module, "silu_mul_triton", lambda x: calls.append(1))
    mlp = MLP(16, 24)
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    mlp(torch.randn(3, 16))
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1024, 2 * 1536, generator=gen, device="cuda") * 4).to(dtype)
    assert torch.equal(silu_mul_triton(x), silu_mul_ref(x))
    mlp = MLP(2048, 1536, dtype, "cuda")
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.02)
    h = torch.randn(64, 2048, generator=gen, device="cuda").to(dtype)
    gate_up = torch.nn.functional.linear(h, mlp.gate_up_proj)
    want = torch.nn.functional.linear(silu_mul_ref(gate_up), mlp.down_proj)
    assert torch.equal(mlp(h), want)
