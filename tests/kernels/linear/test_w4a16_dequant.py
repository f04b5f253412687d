"""The W4A16 linear's many-token path (kernels/linear/w4a16_dequant.py): the Triton dequantize
kernel against packed.dequantize (every nibble and scale code, partial tiles, INT4's partial
word and group), the dequant-then-GEMM linear against the float reference and the fused kernel,
and the backend choice. Interpreter cases on CPU in fp32 and fp16; bf16 and a CUDA graph on the
GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.linear import w4a16_dequant
from moeserve.kernels.linear.w4a16_dequant import (
    AUTO_DEQUANT_MIN_TOKENS,
    choose_w4a16_backend,
    dequantize_w4a16,
    scale_columns,
    w4a16_linear,
    w4a16_linear_dequant,
)
from moeserve.kernels.linear.w4a16_triton import w4a16_linear_triton
from moeserve.quant import packed
from moeserve.quant.fp8_block import E4M3
from tests.kernels.linear.test_quant_linear_triton import (
    GPU_SHAPES,
    _assert_matches,
    _quantized,
    _raw_int4,
    _raw_nvfp4,
    _x,
    assert_graph_replays,
)


def _dequant(qw: packed.QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_w4a16(qw.format, qw.qweight, qw.scale, qw.group, qw.logical_shape[-1],
                            dtype)


def _linear(x: torch.Tensor, qw: packed.QuantWeight, fn=w4a16_linear_dequant, **kw):
    return fn(x, qw.format, qw.qweight, qw.scale, qw.global_scale, qw.group,
              qw.logical_shape[-1], **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nvfp4_dequantize_every_nibble_and_scale_code_exactly(dtype: torch.dtype) -> None:
    n, k = 300, 336  # N: a partial last tile of rows; K: a partial last tile of columns
    qweight, scale, _ = _raw_nvfp4(n, k)
    ones = torch.ones(n)  # the global scale is the GEMM's, not the tile's
    expected = packed.dequantize("nvfp4", qweight, scale, ones, 16, k)
    got = dequantize_w4a16("nvfp4", qweight, scale, 16, k, dtype)
    assert got.dtype == dtype and torch.equal(got.float(), expected)  # exact: <= 7 bits


def test_nvfp4_dequantize_nan_scale_codes_give_nan_as_torch() -> None:
    qweight, scale, _ = _raw_nvfp4(32, 64)
    codes = scale.view(torch.uint8).clone()
    codes[3, 1] = 0x7F
    got = dequantize_w4a16("nvfp4", qweight, codes.view(E4M3), 16, 64, torch.float32)
    assert torch.isnan(got[3, 16:32]).all() and not torch.isnan(got[3, :16]).any()


@pytest.mark.parametrize(("k", "group", "scale_dtype"), [
    (180, 32, torch.float32),   # a partial last word (180 = 22.5 words) and group
    (200, 8, torch.float16),    # the smallest group
    (384, 128, torch.float32)])  # one group a tile
def test_int4_dequantize_equals_the_reference(k: int, group: int,
                                              scale_dtype: torch.dtype) -> None:
    qweight, scale = _raw_int4(70, k, group, scale_dtype)
    expected = packed.dequantize("int4", qweight, scale, None, group, k)
    for dtype in (torch.float32, torch.float16):
        got = dequantize_w4a16("int4", qweight, scale, group, k, dtype)
        assert got.shape == (70, k) and torch.equal(got, expected.to(dtype))


@pytest.mark.parametrize(("fmt", "k", "group"), [("nvfp4", 336, None), ("int4", 200, 32)])
@pytest.mark.parametrize("t", [1, 130])
def test_dequant_linear_fp32_equals_dequantize_then_matmul(fmt: str, k: int, group: int | None,
                                                           t: int) -> None:
    qw = _quantized(fmt, 300, k, group)
    x = _x(t, k)
    bias = torch.randn(300)
    _assert_matches(_linear(x, qw, bias=bias), x, qw.dequantize(), rtol=1e-5, bias=bias)


def test_dequant_linear_keeps_leading_dims_fp16_and_matches_the_fused_kernel() -> None:
    qw = _quantized("nvfp4", 96, 128)
    x = _x(6, 128).half().reshape(2, 3, 128)
    out = _linear(x, qw)
    fused = _linear(x, qw, fn=w4a16_linear_triton)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float16
    # the same tiles and one rounding each: they differ by the order of the fp32 sums alone
    torch.testing.assert_close(out, fused, rtol=2 ** -10, atol=1e-3)
    assert _linear(x[:0], qw).shape == (0, 3, 96)


def test_the_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    many = AUTO_DEQUANT_MIN_TOKENS
    assert choose_w4a16_backend(many, cpu, torch.float16, 16) == "fused"  # the interpreter
    monkeypatch.setattr(w4a16_dequant, "fp32_result_mm", lambda device, dtype: True)
    assert choose_w4a16_backend(many, cuda, torch.bfloat16, 16) == "dequant"
    assert choose_w4a16_backend(many - 1, cuda, torch.bfloat16, 16) == "fused"
    assert choose_w4a16_backend(many, cuda, torch.bfloat16, 256) == "fused"  # group too wide
    assert choose_w4a16_backend(1, cpu, torch.float32, 16, "dequant") == "dequant"
    assert choose_w4a16_backend(many, cuda, torch.bfloat16, 16, "fused") == "fused"
    monkeypatch.setattr(w4a16_dequant, "fp32_result_mm", lambda device, dtype: False)
    assert choose_w4a16_backend(many, cuda, torch.bfloat16, 16) == "fused"  # no fp32 result
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_w4a16_backend(many, cuda, torch.bfloat16, 16, "cublas")
    with pytest.raises(ValueError, match="group 256 does not divide"):
        choose_w4a16_backend(many, cuda, torch.bfloat16, 256, "dequant")


def test_the_entry_point_runs_the_chosen_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    qw = _quantized("int4", 64, 96, 32)
    x = _x(3, 96)
    calls = []
    for name in ("w4a16_linear_dequant", "w4a16_linear_triton"):
        real = getattr(w4a16_dequant, name)
        monkeypatch.setattr(w4a16_dequant, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    for choice in ("dequant", "fused"):
        monkeypatch.setattr(w4a16_dequant, "backend", choice)
        _assert_matches(_linear(x, qw, fn=w4a16_linear), x, qw.dequantize(), rtol=1e-5)
    assert calls == ["w4a16_linear_dequant", "w4a16_linear_triton"]


def test_bad_inputs_are_named() -> None:
    qw = _quantized("nvfp4", 64, 128)
    with pytest.raises(ValueError, match=r"x must be \[..., 128\]"):
        _linear(_x(2, 64), qw)
    with pytest.raises(ValueError, match="nvfp4 scale must be float8_e4m3fn"):
        w4a16_linear_dequant(_x(2, 128), "nvfp4", qw.qweight, qw.scale.float(),
                             qw.global_scale, 16, 128)


@pytest.mark.parametrize("with_g", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_epilogue_is_one_rounding_of_the_fp32_scale_and_bias(with_g: bool,
                                                                 with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    acc = torch.randn(37, 300, generator=gen) * 50  # partial tiles both ways
    g = torch.rand(300, generator=gen) + 0.5 if with_g else None
    bias = torch.randn(300, generator=gen).half() if with_bias else None
    expected = acc.clone()
    if g is not None:
        expected = expected * g
    if bias is not None:
        expected = expected + bias.float()
    assert torch.equal(scale_columns(acc, g, bias, torch.float16), expected.half())
    assert scale_columns(acc[:0], g, bias, torch.float16).shape == (0, 300)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_the_fp16_linear_with_bias_rounds_the_fp32_result_once(fmt: str) -> None:
    qw = _quantized(fmt, 160, 256, 32 if fmt == "int4" else None)
    x = _x(5, 256).half()
    bias = torch.randn(160).half()
    acc = x.float() @ _dequant(qw, torch.float16).float().t()
    if fmt == "nvfp4":
        acc = acc * qw.global_scale
    assert torch.equal(_linear(x, qw, bias=bias), (acc + bias.float()).half())


# ---- GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n", "k"), [(1024, 5120, 2048), *GPU_SHAPES])
@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", None), ("int4", 32)])
def test_gpu_dequant_linear_bf16(t: int, n: int, k: int, fmt: str, group: int | None) -> None:
    qw = _quantized(fmt, n, k, group, scale_dtype=torch.bfloat16, device="cuda")
    x = _x(t, k, device="cuda").bfloat16()
    assert torch.equal(_dequant(qw, torch.bfloat16).cpu(),
                       packed.dequantize(fmt, qw.qweight.cpu(), qw.scale.cpu(),
                                         None if qw.global_scale is None
                                         else torch.ones(n), qw.group, k, torch.bfloat16))
    # bf16: the output's one rounding (2^-9); int4's tile rounds as the fused kernel's does
    _assert_matches(_linear(x, qw), x, qw.dequantize(), rtol=2 ** -8)
    assert choose_w4a16_backend(t, x.device, x.dtype, qw.group) == (
        "dequant" if t >= AUTO_DEQUANT_MIN_TOKENS else "fused")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_gpu_dequant_linear_bf16_bias_and_epilogue(fmt: str) -> None:
    qw = _quantized(fmt, 2048, 1024, 32 if fmt == "int4" else None,
                    scale_dtype=torch.bfloat16, device="cuda")
    x = _x(300, 1024, device="cuda").bfloat16()
    bias = torch.randn(2048, device="cuda").bfloat16()
    acc = torch.mm(x, _dequant(qw, torch.bfloat16).t(), out_dtype=torch.float32)
    if fmt == "nvfp4":
        acc = acc * qw.global_scale
    expected = (acc + bias.float()).bfloat16()
    out = _linear(x, qw, bias=bias)
    if fmt == "nvfp4":  # the same fp32 sums, then scale_columns' one pass, whose mul and add
        # the GPU contracts into one FMA (an fp32 rounding fewer than torch's two ops): the
        # bf16 results agree to one rounding of their own (the CPU tests: bit for bit)
        torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=0)
        assert (out != expected).float().mean() < 0.01
    else:  # cuBLAS's bf16 GEMM with the bias: one rounding of its own fp32 sums
        torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=1e-2)
    g = qw.global_scale if fmt == "nvfp4" else None
    assert torch.equal(scale_columns(acc, g, None, torch.bfloat16),
                       (acc * (g if g is not None else 1.0)).bfloat16())


@pytest.mark.gpu
def test_gpu_dequant_linear_in_a_cuda_graph() -> None:
    qw = _quantized("nvfp4", 1000, 2048, None, scale_dtype=torch.bfloat16, device="cuda")
    x = _x(256, 2048, device="cuda").bfloat16()
    assert_graph_replays(lambda: _linear(x, qw), x)
