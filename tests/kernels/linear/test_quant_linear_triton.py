"""The linear kernels on quant/packed.py's in-memory layouts, against `packed.dequantize` and a
float matmul: kernels/linear/w4a16_triton.py (NVFP4 and INT4, weight-only) and
kernels/linear/fp8_block_triton.py with per-row FP8 scales (scale_rows 1). Interpreter cases on
CPU in fp32 (to fp32 summation order) and fp16; bf16 and a CUDA graph on the GPU."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.linear.fp8_block_triton import fp8_linear_triton, w8a8_block_matmul_triton
from moeserve.kernels.linear.w4a16_triton import _default_config, w4a16_linear_triton
from moeserve.kernels.triton_common import split_k_for
from moeserve.quant import packed
from moeserve.quant.fp8_block import (
    E4M3,
    quantize_activations,
    quantize_blockwise,
    w8a8_linear_ref,
)

# e4m3's bytes but its two NaN codes (0x7F, 0xFF)
FINITE_E4M3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _x(t: int, k: int, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    """[T, K] activations whose rows span three decades."""
    g = _gen(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-1, 2, t)[:, None]
    return x.to(device)


def _quantized(fmt: str, n: int, k: int, group: int | None = None,
               scale_dtype: torch.dtype = torch.float32, seed: int = 0,
               device: str = "cpu") -> packed.QuantWeight:
    """A QuantWeight [N, K] holding random rows (magnitudes over three decades) quantized by
    packed.quantize_into."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n)[:, None]
    qw = packed.QuantWeight(fmt, n, k, scale_dtype=scale_dtype, device=device,
                            int4_group=group)
    packed.quantize_into(qw.view_of(), w.to(device), qw.group)
    return qw


def _raw_nvfp4(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random bytes in the NVFP4 layout: every nibble, every finite e4m3 scale (subnormal and
    negative ones too), a global scale per row."""
    g = _gen(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=g).to(torch.uint8)  # [N, K / 2]
    codes = FINITE_E4M3[torch.randint(0, len(FINITE_E4M3), (n, k // 16), generator=g)]
    global_scale = torch.rand(n, generator=g) + 0.01  # [N]
    return qweight, codes.view(E4M3), global_scale


def _raw_int4(n: int, k: int, group: int, scale_dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random words in the INT4 layout (the padding nibbles of the last word too) and scales."""
    g = _gen(seed)
    words = -(-k // 8)
    qweight = torch.randint(-2**31, 2**31, (n, words), generator=g, dtype=torch.int64)
    scale = torch.randn(n, -(-k // group), generator=g).to(scale_dtype)
    return qweight.to(torch.int32), scale


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [T, K] @ w [N, K].T in fp32 (+ bias): the kernels' result before the one rounding."""
    out = x.float() @ w.float().t()
    return out if bias is None else out + bias.float()


def _assert_matches(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float,
                    bias: torch.Tensor | None = None) -> None:
    """|out - ref| <= rtol x (sum over k of |x w|): a summation-order bound, sound also where
    the sum cancels to about zero."""
    ref = _reference(x, w, bias)
    bound = x.float().abs() @ w.float().abs().t() + (0 if bias is None else bias.abs().float())
    err = (out.float() - ref).abs()
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert (err <= rtol * bound).all(), (err / bound.clamp(min=1e-30)).max()


def _run(x: torch.Tensor, qw: packed.QuantWeight, **kw) -> torch.Tensor:
    return w4a16_linear_triton(x, qw.format, qw.qweight, qw.scale, qw.global_scale, qw.group,
                               qw.logical_shape[-1], **kw)


# ---- W4A16: NVFP4 and INT4 ----------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 5, 64])
@pytest.mark.parametrize(("fmt", "k", "group"), [("nvfp4", 336, None), ("int4", 320, 32),
                                                  ("int4", 200, 32)])
def test_w4a16_fp32_equals_dequantize_then_matmul(t: int, fmt: str, k: int,
                                                  group: int | None) -> None:
    # N 300: a partial last tile of N; int4 K 200: a partial last group (ceil(200 / 32) = 7)
    qw = _quantized(fmt, 300, k, group)
    x = _x(t, k)
    _assert_matches(_run(x, qw), x, qw.dequantize(), rtol=1e-5)


def test_nvfp4_raw_bytes_every_nibble_and_scale_code() -> None:
    n, k = 300, 336
    qweight, scale, global_scale = _raw_nvfp4(n, k)
    assert len(torch.unique(qweight & 0xF)) == 16 and len(torch.unique(qweight >> 4)) == 16
    w = packed.dequantize("nvfp4", qweight, scale, global_scale, 16, k)
    x = _x(5, k)
    out = w4a16_linear_triton(x, "nvfp4", qweight, scale, global_scale, 16, k)
    _assert_matches(out, x, w, rtol=1e-5)


def test_nvfp4_nan_scale_code_is_nan_as_in_torch() -> None:
    qweight, scale, global_scale = _raw_nvfp4(32, 64)
    codes = scale.view(torch.uint8).clone()
    codes[3, 1], codes[7, 2] = 0x7F, 0xFF  # e4m3's NaNs
    scale = codes.view(E4M3)
    x = _x(2, 64)
    out = w4a16_linear_triton(x, "nvfp4", qweight, scale, global_scale, 16, 64)
    ref = _reference(x, packed.dequantize("nvfp4", qweight, scale, global_scale, 16, 64))
    assert torch.equal(out.isnan(), ref.isnan()) and out[:, 3].isnan().all()
    finite = ~ref.isnan()
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(("k", "scale_dtype"), [(180, torch.float32), (200, torch.float16),
                                                (256, torch.bfloat16)])
def test_int4_raw_words_every_nibble(k: int, scale_dtype: torch.dtype) -> None:
    # K 180: the last word holds 4 elements and 4 nibbles of random padding, which must not
    # count; bf16 scales are loaded (and widened) exactly by the interpreter
    n, group = 300, 32
    qweight, scale = _raw_int4(n, k, group, scale_dtype)
    w = packed.dequantize("int4", qweight, scale, None, group, k)
    x = _x(5, k)
    out = w4a16_linear_triton(x, "int4", qweight, scale, None, group, k)
    _assert_matches(out, x, w, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize(("fmt", "k", "group"), [("nvfp4", 336, None), ("int4", 200, 32)])
def test_w4a16_fp16(t: int, fmt: str, k: int, group: int | None) -> None:
    qw = _quantized(fmt, 300, k, group, scale_dtype=torch.float16)
    x = _x(t, k).half()
    # fp16: the int4 weight tile's rounding to fp16 and the output's (NVFP4's tile is exact)
    _assert_matches(_run(x, qw), x, qw.dequantize(), rtol=2e-3)


@pytest.mark.parametrize(("fmt", "k", "group", "config"), [
    ("nvfp4", 336, None, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)),
    ("nvfp4", 336, None, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=8)),
    ("int4", 200, 32, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_stages=2)),
    ("int4", 320, 64, dict(BLOCK_K=256))])
def test_w4a16_config_override_keeps_the_result(fmt: str, k: int, group: int | None,
                                                config: dict[str, int]) -> None:
    qw = _quantized(fmt, 300, k, group)
    x = _x(7, k)
    _assert_matches(_run(x, qw, config=config), x, qw.dequantize(), rtol=1e-5)


def test_w4a16_keeps_leading_dims_adds_bias_and_takes_no_tokens() -> None:
    qw = _quantized("int4", 96, 128, 32)
    x = _x(6, 128)
    bias = torch.linspace(-1, 1, 96)
    out = _run(x.view(2, 3, 128), qw, bias=bias)
    assert out.shape == (2, 3, 96)
    _assert_matches(out.view(6, 96), x, qw.dequantize(), rtol=1e-5, bias=bias)
    strided = _x(6, 256)[:, ::2]  # a non-unit stride along K
    _assert_matches(_run(strided, qw), strided, qw.dequantize(), rtol=1e-5)
    assert _run(x[:0], qw).shape == (0, 96)


def test_default_tiles_follow_the_token_count() -> None:
    cpu = torch.device("cpu")
    assert _default_config(1, 2048, 4096, 32, cpu)["BLOCK_M"] == 16  # decode
    assert _default_config(16, 2048, 4096, 16, cpu)["BLOCK_M"] == 16
    assert _default_config(4096, 2048, 4096, 32, cpu)["BLOCK_M"] == 64
    assert _default_config(1, 2048, 4096, 256, cpu)["BLOCK_K"] == 256  # a multiple of the group
    assert _default_config(1, 2048, 4096, 32, cpu)["SPLIT_K"] == 1  # CUDA only


def test_split_k_brings_the_programs_to_two_an_sm() -> None:
    assert split_k_for(32, 32, 132) == 8  # 32 tiles x 8 = 256 programs, 4 steps a split
    assert split_k_for(32, 16, 132) == 4  # K caps it: at least 4 steps a split
    assert split_k_for(300, 64, 132) == 1  # enough programs already
    assert split_k_for(1, 3, 132) == 1


@pytest.mark.parametrize("fmt,group", [("nvfp4", None), ("int4", 32)])
@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_k_matches_one_split(fmt: str, group: int | None, split: int) -> None:
    """Each split's partial sums, added in a fixed order, with the bias after: the reference's
    result as one split's (an uneven split, 3, leaves the last split fewer steps; 8 splits of 5
    steps leave some empty)."""

    qw = _quantized(fmt, 96, 320, group)
    x, bias = _x(5, 320), torch.linspace(-1, 1, 96)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split)
    for c in (cfg, {**cfg, "SPLIT_K": 1}):  # the same bound: only the fp32 order differs
        _assert_matches(_run(x, qw, bias=bias, config=c), x, qw.dequantize(), rtol=1e-5,
                        bias=bias)


def test_w4a16_bad_inputs_are_named() -> None:
    nv = _quantized("nvfp4", 64, 64)
    i4 = _quantized("int4", 64, 64, 32)
    x = _x(3, 64)
    q, s, g = nv.qweight, nv.scale, nv.global_scale
    bad = [
        (dict(fmt="fp4"), "fmt must be one of"),
        (dict(qweight=q.view(torch.int8)), r"nvfp4 qweight must be uint8 \[64, 32\]"),
        (dict(scale=s.float()), r"nvfp4 scale must be float8_e4m3fn \[64, 4\]"),
        (dict(scale=s[:, :2]), r"nvfp4 scale must be float8_e4m3fn \[64, 4\]"),
        (dict(global_scale=None), r"global_scale must be fp32 \[64\]"),
        (dict(global_scale=g.half()), r"global_scale must be fp32 \[64\]"),
        (dict(group=32), "nvfp4's group is 16"),
        (dict(x=x.int()), "x must be fp32 / fp16 / bf16"),
        (dict(x=x[:, :48]), r"x must be \[..., 64\]"),
        (dict(x=x.bfloat16()), "bf16 x is not supported on CPU"),
        (dict(bias=torch.zeros(63)), r"bias must be float \[64\]"),
        (dict(config=dict(BLOCK_K=8)), "BLOCK_K must be a power of two >= 16"),
        (dict(config=dict(BLOCK_N=48)), "BLOCK_N must be a power of two >= 16"),
        (dict(config=dict(BLOCK_K=16)), "nvfp4 needs at least 32"),
        (dict(config=dict(BLOCK_SIZE=64)), r"unknown config keys \['BLOCK_SIZE'\]"),
    ]
    base = dict(x=x, fmt="nvfp4", qweight=q, scale=s, global_scale=g, group=16, k=64)
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            w4a16_linear_triton(**{**base, **change})
    with pytest.raises(ValueError, match="nvfp4 needs K a multiple of 16"):
        w4a16_linear_triton(_x(3, 40), "nvfp4", q[:, :20], s[:, :3], g, 16, 40)
    base = dict(x=x, fmt="int4", qweight=i4.qweight, scale=i4.scale, global_scale=None,
                group=32, k=64)
    bad = [
        (dict(qweight=i4.qweight.view(torch.float32)), r"int4 qweight must be int32 \[64, 8\]"),
        (dict(qweight=i4.qweight[:, :7]), r"int4 qweight must be int32 \[64, 8\]"),
        (dict(scale=i4.scale[:, :1]), r"int4 scale must be float \[64, 2\]"),
        (dict(scale=i4.scale.to(torch.int32)), r"int4 scale must be float \[64, 2\]"),
        (dict(global_scale=g), "int4 takes no global_scale"),
        (dict(group=48), "a power of two and a multiple of 8"),
        (dict(config=dict(BLOCK_K=16)), "BLOCK_K 16 must be a multiple of the group 32"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            w4a16_linear_triton(**{**base, **change})


# ---- FP8 with per-row scales (packed.py's scale_rows 1) ------------------------------------

def _fp8_per_row_ref(x: torch.Tensor, qw: packed.QuantWeight) -> torch.Tensor:
    """w8a8_linear_ref's arithmetic on packed.py's layout: x quantized per token and 128-group,
    dequantized, times packed.dequantize's weight, in fp32."""
    k = x.shape[-1]
    x_q, x_scale = quantize_activations(x)
    x_deq = x_q.float() * x_scale.repeat_interleave(128, 1)[:, :k]  # [T, K]
    return x_deq @ qw.dequantize().t()


@pytest.mark.parametrize(("t", "n", "k"), [(1, 300, 336), (5, 200, 320), (64, 128, 100)])
@pytest.mark.parametrize("block_n", [64, 256])  # per-row scales: any block_n
def test_fp8_per_row_scales_equal_the_reference(t: int, n: int, k: int, block_n: int) -> None:
    qw = _quantized("fp8", n, k)
    assert qw.scale.shape == (n, -(-k // 128)) and qw.scale_rows == 1
    x = _x(t, k)
    ref = _fp8_per_row_ref(x, qw)
    # the same sum as quant/fp8_block.py's reference with (1, 128) blocks
    torch.testing.assert_close(ref, w8a8_linear_ref(x, qw.qweight, qw.scale, block=(1, 128)))
    xq, xs = quantize_activations(x)
    out = w8a8_block_matmul_triton(xq, xs, qw.qweight, qw.scale, torch.float32, block_m=16,
                                   block_n=block_n, scale_rows=1)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max())


def test_fp8_linear_per_row_keeps_shape_and_bias() -> None:
    qw = _quantized("fp8", 192, 320)
    x = _x(6, 320)
    bias = torch.linspace(-1, 1, 192)
    out = fp8_linear_triton(x.view(2, 3, 320), qw.qweight, qw.scale, bias, scale_rows=1)
    ref = _fp8_per_row_ref(x, qw) + bias
    assert out.shape == (2, 3, 192)
    assert torch.allclose(out.view(6, 192), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


def test_fp8_block_scales_and_their_per_row_expansion_agree() -> None:
    # the checkpoint's 128-row blocks and the same scales repeated per row (the loader's
    # layout before compaction): the same per-element scale, so the same sums
    n, k = 200, 256
    wq, ws = quantize_blockwise(torch.randn(n, k, generator=_gen(3)))  # ws [2, 2]
    per_row = ws.repeat_interleave(128, 0)[:n].contiguous()  # [200, 2]
    x = _x(5, k)
    blocks = fp8_linear_triton(x, wq, ws)
    rows = fp8_linear_triton(x, wq, per_row, scale_rows=1)
    torch.testing.assert_close(rows, blocks, rtol=1e-6, atol=0.0)


def test_fp8_scale_rows_bad_inputs_are_named() -> None:
    qw = _quantized("fp8", 128, 256)
    xq, xs = quantize_activations(_x(4, 256))
    with pytest.raises(ValueError, match="scale_rows must be 1 or 128, got 64"):
        w8a8_block_matmul_triton(xq, xs, qw.qweight, qw.scale, torch.float32, scale_rows=64)
    with pytest.raises(ValueError, match=r"w_scale must be \(1, 2\) .* scale_rows 128"):
        w8a8_block_matmul_triton(xq, xs, qw.qweight, qw.scale, torch.float32)
    _, block_scale = quantize_blockwise(torch.randn(128, 256))
    with pytest.raises(ValueError, match=r"w_scale must be \(128, 2\) .* scale_rows 1"):
        w8a8_block_matmul_triton(xq, xs, qw.qweight, block_scale, torch.float32, scale_rows=1)
    with pytest.raises(ValueError, match="block_n 256 must divide 128"):
        w8a8_block_matmul_triton(xq, xs, qw.qweight, block_scale, torch.float32, block_n=256)


# ---- GPU ----------------------------------------------------------------------------------

# (tokens, out, in): decode, a small and a large prefill at Kimi K2 / GLM-5 projection sizes
GPU_SHAPES = [(1, 4096, 7168), (37, 2112, 7168), (512, 7168, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n", "k"), GPU_SHAPES)
@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", None), ("int4", 32)])
def test_gpu_w4a16_bf16(t: int, n: int, k: int, fmt: str, group: int | None,
                        no_tf32: None) -> None:
    qw = _quantized(fmt, n, k, group, scale_dtype=torch.bfloat16, device="cuda")
    x = _x(t, k, device="cuda").bfloat16()
    # bf16: the output's rounding (2^-9) and int4's weight tile's (2^-9 of each |x w|); NVFP4's
    # tile is exact. Against the sum of |x w|: outputs that cancel to ~0 are common here
    _assert_matches(_run(x, qw), x, qw.dequantize(), rtol=2 ** -8)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n", "k"), GPU_SHAPES)
def test_gpu_nvfp4_asm_decode_gives_the_same_bits(t: int, n: int, k: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """nvfp4_tile's "asm" decode against "bits": the same tiles, so the same output bits."""
    from moeserve.kernels.linear import nvfp4_tile

    qw = _quantized("nvfp4", n, k, None, scale_dtype=torch.bfloat16, device="cuda")
    x = _x(t, k, device="cuda").bfloat16()
    monkeypatch.setattr(nvfp4_tile, "decode", "bits")
    expected = _run(x, qw)
    monkeypatch.setattr(nvfp4_tile, "decode", "asm")
    assert torch.equal(_run(x, qw), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 37, 512])  # the three default tiles
@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", None), ("int4", 32), ("int4", 128)])
def test_gpu_w4a16_fp32_default_tiles(t: int, fmt: str, group: int | None,
                                      no_tf32: None) -> None:
    qw = _quantized(fmt, 2112, 2048, group, device="cuda")
    x = _x(t, 2048, device="cuda")
    _assert_matches(_run(x, qw), x, qw.dequantize(), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", None), ("int4", 32)])
def test_gpu_w4a16_fp32_and_in_a_cuda_graph(fmt: str, group: int | None, no_tf32: None) -> None:
    qw = _quantized(fmt, 1000, 2048, group, device="cuda")
    x = _x(24, 2048, device="cuda")
    _assert_matches(_run(x, qw), x, qw.dequantize(), rtol=1e-5)
    assert_graph_replays(lambda: _run(x, qw), x)


def assert_graph_replays(run, x: torch.Tensor) -> None:
    """run() captured in a CUDA graph replays on x's new values (doubled in place): the replay
    equals an eager call on them and differs from the first output."""
    expected = run()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
    assert not torch.allclose(out, expected)


@pytest.mark.gpu
def test_gpu_fp8_per_row_scales_bf16() -> None:
    qw = _quantized("fp8", 2112, 7168, device="cuda")
    x = _x(64, 7168, device="cuda").bfloat16()
    out = fp8_linear_triton(x, qw.qweight, qw.scale, scale_rows=1)
    ref = _fp8_per_row_ref(x.float(), qw)
    err = (out.float() - ref).abs() / (ref.abs() + ref.abs().mean())
    assert out.dtype == torch.bfloat16 and err.max() < 2 ** -7, err.max()
