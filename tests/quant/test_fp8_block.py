"""quant/fp8_block.py: the FP8 block-scaled layout, checked against an independent decoder.

The decoder reads e4m3 bytes from the format's published definition (OCP FP8 E4M3: 1 sign, 4
exponent bits with bias 7, 3 mantissa bits; exponent 0 is subnormal, 2^-6 x m / 8; S.1111.111
is NaN, no infinities), not through torch's float8 conversion, and the scales are applied
block by block in Python loops. A transposed or misindexed scale, or a wrong byte layout,
cannot pass both ways. Dimensions of 320 give two full 128-blocks and a partial one of 64.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeserve.quant.fp8_block import (
    E4M3,
    check_weight,
    dequantize_blockwise,
    quantize_activations,
    quantize_blockwise,
    scale_shape,
    w8a8_linear_ref,
)


def decode_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * 2.0 ** -6 * man / 8
    return sign * 2.0 ** (exp - 7) * (1 + man / 8)


def decode_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128
                  ) -> torch.Tensor:
    raw = weight.view(torch.uint8).tolist()
    scales = scale_inv.tolist()
    return torch.tensor([[decode_e4m3(b) * scales[i // block][j // block]
                          for j, b in enumerate(row)] for i, row in enumerate(raw)])


def test_decoder_agrees_with_known_values() -> None:
    assert decode_e4m3(0x7E) == 448.0  # S.1111.110: the largest finite value
    assert decode_e4m3(0x01) == 2.0 ** -9  # the smallest subnormal
    assert decode_e4m3(0x38) == 1.0 and decode_e4m3(0xC0) == -2.0
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    ours = torch.tensor([decode_e4m3(b) for b in range(256)])
    assert torch.equal(every.isnan(), ours.isnan())
    assert torch.equal(every[~every.isnan()], ours[~ours.isnan()])


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows and column blocks of very different magnitudes, so each block's scale differs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    rows = torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)]
    cols = torch.logspace(-2, 0, k)[torch.randperm(k, generator=g)]
    return w * rows[:, None] * cols[None, :]


@pytest.mark.parametrize(("n", "k"), [(320, 320), (320, 192), (128, 128), (7, 130)])
def test_quantized_weights_decode_independently(n: int, k: int) -> None:
    w = _weight(n, k)
    q, scale = quantize_blockwise(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    assert tuple(scale.shape) == scale_shape(n, k) == (math.ceil(n / 128), math.ceil(k / 128))
    ours = dequantize_blockwise(q, scale)
    assert torch.equal(ours, decode_weight(q, scale))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, and subnormals' step is scale * 2^-9
    per_elem = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert ((ours - w).abs() <= w.abs() / 16 + per_elem * 2.0 ** -9).all()


def test_a_transposed_scale_is_caught() -> None:
    w = _weight(320, 320)
    q, scale = quantize_blockwise(w)
    assert not torch.allclose(dequantize_blockwise(q, scale.t().contiguous()), w, rtol=0.1)
    with pytest.raises(ValueError, match=r"layers.0.q_proj.weight_scale_inv: shape \(2, 3\)"):
        check_weight("layers.0.q_proj.weight", q[:, :192], scale.t()[:2].contiguous())


def test_bad_weights_are_named() -> None:
    q, scale = quantize_blockwise(_weight(256, 256))
    with pytest.raises(ValueError, match="experts.3.down_proj.weight: FP8 weight must be "
                                         "float8_e4m3fn, got torch.bfloat16"):
        check_weight("experts.3.down_proj.weight", q.to(torch.bfloat16), scale)
    with pytest.raises(ValueError, match="scales must be float32"):
        check_weight("w", q, scale.to(E4M3))


def test_activations_are_quantized_per_token_and_group() -> None:
    x = _weight(5, 320, seed=1)
    x[2] *= 1000  # one loud token must not change the others' scales
    q, s = quantize_activations(x)
    assert tuple(s.shape) == (5, 3)
    raw = q.view(torch.uint8).tolist()
    for t in range(5):
        for kb in range(3):
            cols = range(kb * 128, min(320, (kb + 1) * 128))
            amax = max(abs(float(x[t, c])) for c in cols)
            assert float(s[t, kb]) == pytest.approx(amax / 448, rel=1e-6)
            assert max(abs(decode_e4m3(raw[t][c])) for c in cols) == 448.0


def test_w8a8_linear_is_the_blockwise_sum_of_scaled_products() -> None:
    x, w = _weight(3, 320, seed=2), _weight(200, 320, seed=3)
    wq, ws = quantize_blockwise(w)
    out = w8a8_linear_ref(x, wq, ws)
    xq, xs = quantize_activations(x)
    xr, wr = xq.view(torch.uint8).tolist(), wq.view(torch.uint8).tolist()
    for t in range(3):
        for n in (0, 127, 128, 199):
            expected = 0.0
            for kb in range(3):
                cols = range(kb * 128, min(320, (kb + 1) * 128))
                part = sum(decode_e4m3(xr[t][c]) * decode_e4m3(wr[n][c]) for c in cols)
                expected += float(xs[t, kb]) * float(ws[n // 128, kb]) * part
            assert float(out[t, n]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # and it stays close to the unquantized product (both sides at 3 mantissa bits)
    exact = x @ w.t()
    assert ((out - exact).norm() / exact.norm()) < 0.05


def test_w8a8_keeps_shape_dtype_and_bias() -> None:
    x = _weight(6, 256, seed=4).view(2, 3, 256)
    wq, ws = quantize_blockwise(_weight(64, 256, seed=5))
    bias = torch.arange(64, dtype=torch.float32)
    out = w8a8_linear_ref(x, wq, ws, bias=bias)
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    assert torch.allclose(out - w8a8_linear_ref(x, wq, ws), bias.expand(2, 3, 64), atol=1e-4)
    half = w8a8_linear_ref(x.to(torch.bfloat16), wq, ws)
    assert half.dtype == torch.bfloat16 and half.shape == (2, 3, 64)
    with pytest.raises(ValueError, match="input has 128 features, the weight 256"):
        w8a8_linear_ref(x[..., :128], wq, ws)
