"""kernels/linear/fp8_block_triton.py against quant/fp8_block.py's references: the activation
quantization byte for byte, the block-scaled GEMM and the whole W8A8 linear to fp32 summation
order. Interpreter cases on CPU (its fp8 loads and dots are exact); GPU cases at projection
shapes of the served models, in bf16, and under CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.linear.fp8_block_triton import (
    fp8_linear_triton,
    quantize_activations_triton,
    w8a8_block_matmul_triton,
)
from moeserve.quant.fp8_block import (
    E4M3,
    quantize_activations,
    quantize_blockwise,
    w8a8_linear_ref,
)


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """A W8A8 GPU output (bf16) against w8a8_linear_ref in fp32, to Hopper's FP8 accuracy.

    Mean: sum |out - ref| / sum |ref| < 1e-3 (vLLM's w8a8 block tests' bound) against the
    reference rounded to out's dtype, so that the bf16 rounding itself (about 1.3e-3 on
    average) is not counted. Max: 2^-5 of the output scale, |out - ref| / (|ref| + mean
    |ref|). Hopper's FP8 tensor cores accumulate one dot in about 14 bits of the fp32
    accumulator (DeepSeek-V3's report, section 3.3.2; Triton's sm90 default, our dot spanning
    one 128-wide K block, promoted to fp32 each block): benchmarks/results/gpu_7e90c0c/
    fp8_diag.txt measured 1.35% at one element of 1024 x 5120 x 2048 (1.0% at 64 x 2048 x
    4096), mean 3.1e-5, with the activation bytes and scales exactly the reference's and an
    fp32 torch matmul of the same dequantized inputs at 4.9e-5 max; 2^-7 (bf16 rounding
    alone) was too tight for that."""
    rounded = ref.to(out.dtype).float()
    mean_rel = ((out.float() - rounded).abs().sum() / rounded.abs().sum()).item()
    assert mean_rel < 1e-3, mean_rel
    err = (out.float() - ref).abs() / (ref.abs() + ref.abs().mean())
    assert err.max() < 2 ** -5, err.max()


def _data(t: int, n: int, k: int, device: str = "cpu", seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-2, 1, t)[:, None]
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]
    return x.to(device), w.to(device)


@pytest.mark.gpu  # the interpreter's fp32 -> e4m3 cast drops mantissa carries (module doc)
@pytest.mark.parametrize(("t", "k"), [(1, 128), (5, 320), (3, 64), (7, 1000), (4096, 7168)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_activation_quantization_equals_the_reference_bytes(t: int, k: int,
                                                                dtype: torch.dtype) -> None:
    x, _ = _data(t, 1, k, device="cuda")
    x = x.to(dtype)
    q, s = quantize_activations_triton(x)
    q_ref, s_ref = quantize_activations(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize(("t", "k", "block_rows"), [(5, 320, 16), (70, 256, 64), (1, 100, 16)])
def test_activation_kernel_layouts_agree(t: int, k: int, block_rows: int) -> None:
    """Rows a program and cuBLAS's layout (rows padded to 4, token-major scales) give the
    same scales and bytes as the one-row-a-program plain layout (the interpreter's e4m3
    cast is wrong, so bytes are compared kernel to kernel; the scales to the reference)."""
    x, _ = _data(t, 1, k)
    q1, s1 = quantize_activations_triton(x, block_rows=1)
    q, s = quantize_activations_triton(x, block_rows=block_rows, pad_rows_to=4,
                                       mn_major_scales=True)
    rows = -(-t // 4) * 4
    assert q.shape == (rows, k) and s.shape == (rows, s1.shape[1])
    assert s.stride() == (1, rows)
    assert torch.equal(s[:t], s1) and torch.equal(s1, quantize_activations(x)[1])
    assert torch.equal(q[:t].view(torch.uint8), q1.view(torch.uint8))
    assert not q[t:].float().any() and torch.all(s[t:] == 1e-12)
    q2, s2 = quantize_activations_triton(x, block_rows=block_rows)
    assert s2.stride() == (s1.shape[1], 1) and torch.equal(s2, s1)
    assert torch.equal(q2.view(torch.uint8), q1.view(torch.uint8))


@pytest.mark.parametrize(("t", "n", "k"), [(3, 200, 320), (70, 128, 256), (1, 64, 100)])
def test_block_matmul_equals_the_reference(t: int, n: int, k: int) -> None:
    x, w = _data(t, n, k)
    wq, ws = quantize_blockwise(w)
    xq, xs = quantize_activations(x)
    out = w8a8_block_matmul_triton(xq, xs, wq, ws, torch.float32, block_m=16, block_n=64)
    ref = w8a8_linear_ref(x, wq, ws)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max())


@pytest.mark.parametrize("split_k", [2, 3])
def test_block_matmul_split_over_k_equals_the_reference(split_k: int) -> None:
    """Each K split's fp32 partial sums added after (the decode default on CUDA): 5 K blocks
    in 2 or 3 splits, the last one shorter."""
    x, w = _data(5, 192, 600)
    wq, ws = quantize_blockwise(w)
    xq, xs = quantize_activations(x)
    out = w8a8_block_matmul_triton(xq, xs, wq, ws, torch.float32, block_n=64, split_k=split_k)
    ref = w8a8_linear_ref(x, wq, ws)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max())
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        w8a8_block_matmul_triton(xq, xs, wq, ws, torch.float32, split_k=0)


def test_the_linear_keeps_shape_dtype_and_bias() -> None:
    x, w = _data(6, 192, 320)
    wq, ws = quantize_blockwise(w)
    bias = torch.linspace(-1, 1, 192)
    out = fp8_linear_triton(x.view(2, 3, 320), wq, ws, bias)
    ref = w8a8_linear_ref(x.view(2, 3, 320), wq, ws, bias=bias)
    assert out.shape == (2, 3, 192) and out.dtype == torch.float32
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    empty = fp8_linear_triton(x[:0], wq, ws)
    assert empty.shape == (0, 192)


def test_bad_inputs_are_named() -> None:
    x, w = _data(4, 128, 256)
    wq, ws = quantize_blockwise(w)
    xq, xs = quantize_activations(x)
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        w8a8_block_matmul_triton(x, xs, wq, ws, torch.float32)
    with pytest.raises(ValueError, match=r"w_scale must be \(1, 2\)"):
        w8a8_block_matmul_triton(xq, xs, wq, ws.t(), torch.float32)
    with pytest.raises(ValueError, match=r"x_scale must be fp32 \[4, 2\]"):
        w8a8_block_matmul_triton(xq, xs[:, :1], wq, ws, torch.float32)
    with pytest.raises(ValueError, match="block_n 96 must divide 128"):
        w8a8_block_matmul_triton(xq, xs, wq, ws, torch.float32, block_n=96)
    with pytest.raises(ValueError, match="x must be a 2-D float tensor"):
        quantize_activations_triton(xq.view(torch.uint8))


# ---- GPU ----------------------------------------------------------------------------------

# (tokens, out, in): qwen3-30b-a3b's qkv (5120 x 2048) and o_proj, DeepSeek-V3's q_a (2112 rows
# with kv_a: a partial 128-block of N) and kv_b's K of 512
GPU_SHAPES = [(1024, 5120, 2048), (64, 2048, 4096), (256, 2112, 7168), (3, 32768, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n", "k"), GPU_SHAPES)
def test_gpu_linear_matches_the_reference(t: int, n: int, k: int) -> None:
    x, w = _data(t, n, k, device="cuda")
    wq, ws = quantize_blockwise(w)
    x = x.to(torch.bfloat16)
    out = fp8_linear_triton(x, wq, ws)
    ref = w8a8_linear_ref(x.float(), wq, ws)
    assert out.dtype == torch.bfloat16
    assert_matches_reference(out, ref)


@pytest.mark.gpu
def test_gpu_linear_in_a_cuda_graph() -> None:
    x, w = _data(512, 1024, 2048, device="cuda")
    wq, ws = quantize_blockwise(w)
    x = x.to(torch.bfloat16)
    expected = fp8_linear_triton(x, wq, ws)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear_triton(x, wq, ws)
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), fp8_linear_triton(x, wq, ws).float(), rtol=0, atol=0)
    assert not torch.allclose(out.float(), expected.float())
    assert wq.dtype == E4M3
