"""kernels/linear/fp8_cublas.py: cuBLAS's scale layouts (values, strides, padding), the rules
that pick cuBLAS or Triton (`fp8_linear`'s dispatch, unsupported -> Triton, no probe inside a
graph capture) on CPU; on the GPU (SM90) the cuBLAS path against w8a8_linear_ref, with padded
rows and K blocks, and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.linear import fp8_cublas
from moeserve.kernels.linear.fp8_block_triton import (
    fp8_linear_triton,
    quantize_activations_triton,
)
from moeserve.kernels.linear.fp8_cublas import (
    activation_scale_cublas,
    choose_fp8_backend,
    cublas_support,
    cublas_unfit,
    fp8_linear,
    fp8_linear_cublas,
    weight_scale_cublas,
)
from moeserve.quant.fp8_block import quantize_activations, quantize_blockwise, w8a8_linear_ref
from tests.kernels.linear.test_fp8_linear_triton import _data, assert_matches_reference

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(("nb", "kb"), [(40, 16), (3, 3), (1, 1), (2, 5)])
def test_weight_scale_layout(nb: int, kb: int) -> None:
    w_s = torch.rand(nb, kb) + 0.5  # [N / 128, L]
    b_s = weight_scale_cublas(w_s)
    kb4 = -(-kb // 4) * 4
    assert b_s.shape == (kb4, nb) and b_s.dtype == torch.float32
    assert b_s.stride(0) == 1 and (b_s.stride(1) == kb4 or nb == 1)
    assert torch.equal(b_s[:kb], w_s.t())
    assert not b_s[kb:].any()  # the pad K blocks
    if kb4 == kb:
        assert b_s.data_ptr() == w_s.data_ptr()  # a view: nothing copied a call


def test_weight_scale_layout_of_bf16_or_strided_scales_is_a_copy() -> None:
    w_s = torch.rand(4, 8)
    for s in (w_s.bfloat16(), w_s.t().contiguous().t()):
        b_s = weight_scale_cublas(s)
        assert b_s.dtype == torch.float32 and b_s.stride() == (1, 8)
        assert torch.equal(b_s, s.float().t())


@pytest.mark.parametrize(("t", "rows"), [(5, 8), (8, 8), (1, 4)])
def test_activation_scale_layout(t: int, rows: int) -> None:
    x_s = torch.rand(t, 3)
    a_s = activation_scale_cublas(x_s, rows)
    assert a_s.shape == (rows, 3) and a_s.stride() == (1, rows)
    assert torch.equal(a_s[:t], x_s) and torch.all(a_s[t:] == 1)


def test_the_triton_quantizer_writes_the_cublas_layout() -> None:
    x, _ = _data(6, 1, 384)
    q, s = quantize_activations_triton(x, pad_rows_to=fp8_cublas.M_ALIGN, mn_major_scales=True)
    s_ref = quantize_activations(x)[1]
    assert s.stride() == activation_scale_cublas(s_ref, 8).stride()
    assert torch.equal(s[:6], s_ref) and q.shape == (8, 384)


def test_which_shapes_fit() -> None:
    assert cublas_unfit(5120, 2048, 128) is None
    assert "scale_rows 1" in cublas_unfit(5120, 2048, 1)
    assert "multiples of 128" in cublas_unfit(2112, 7168, 128)  # DeepSeek's q_a + kv_a
    assert "multiples of 128" in cublas_unfit(256, 100, 128)
    assert "not contiguous" in cublas_unfit(256, 256, 128, row_major=False)


def test_without_f_scaled_mm_the_k_blocks_must_not_need_padding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_cublas, "has_scaled_mm_v2", lambda: False)
    assert "multiple of 4" in cublas_unfit(256, 384, 128)
    assert cublas_unfit(256, 512, 128) is None


def _fake_support(monkeypatch: pytest.MonkeyPatch, ok: bool) -> None:
    monkeypatch.setattr(fp8_cublas, "cublas_support",
                        lambda device: (ok, "probed" if ok else "sm80: SM90 only"))


def test_auto_picks_cublas_where_supported_and_the_shape_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_support(monkeypatch, True)
    monkeypatch.setattr(fp8_cublas, "AUTO_CUBLAS_MIN_TOKENS", 1)
    assert choose_fp8_backend(1, 5120, 2048, 128, CUDA) == "cublas"
    assert choose_fp8_backend(4096, 5120, 2048, 1, CUDA) == "triton"  # per-row scales
    assert choose_fp8_backend(64, 2112, 7168, 128, CUDA) == "triton"
    assert choose_fp8_backend(64, 5120, 2048, 128, CUDA, row_major=False) == "triton"
    assert choose_fp8_backend(64, 5120, 2048, 128, CUDA, backend="triton") == "triton"
    monkeypatch.setattr(fp8_cublas, "AUTO_CUBLAS_MIN_TOKENS", 64)
    assert choose_fp8_backend(16, 5120, 2048, 128, CUDA) == "triton"
    assert choose_fp8_backend(64, 5120, 2048, 128, CUDA) == "cublas"
    assert choose_fp8_backend(16, 5120, 2048, 128, CUDA, backend="cublas") == "cublas"


def test_unsupported_falls_back_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_support(monkeypatch, False)
    assert choose_fp8_backend(64, 5120, 2048, 128, CUDA) == "triton"
    with pytest.raises(ValueError, match="cannot run: sm80: SM90 only"):
        choose_fp8_backend(64, 5120, 2048, 128, CUDA, backend="cublas")
    with pytest.raises(ValueError, match="cannot run: scale_rows 1"):
        choose_fp8_backend(64, 5120, 2048, 1, CUDA, backend="cublas")
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_fp8_backend(64, 5120, 2048, 128, CUDA, backend="cutlass")


def test_cpu_is_unsupported_and_runs_triton() -> None:
    assert cublas_support(torch.device("cpu")) == (False, "cpu is not CUDA")
    x, w = _data(6, 256, 256)
    wq, ws = quantize_blockwise(w)
    out = fp8_linear(x.view(2, 3, 256), wq, ws)
    assert torch.equal(out, fp8_linear_triton(x.view(2, 3, 256), wq, ws))


def test_a_first_call_inside_a_capture_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_cublas, "_SUPPORT", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(fp8_cublas, "_probe", lambda device: pytest.fail("probed in capture"))
    ok, why = cublas_support(CUDA)
    assert not ok and "capture" in why
    assert fp8_cublas._SUPPORT == {}  # not cached: the next eager call probes


def test_the_probe_result_is_cached_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(fp8_cublas, "_SUPPORT", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(fp8_cublas, "_probe",
                        lambda device: calls.append(device) or (False, "RuntimeError: no"))
    assert cublas_support(CUDA) == (False, "RuntimeError: no")
    assert cublas_support(CUDA) == (False, "RuntimeError: no")
    assert calls == [CUDA]


# ---- GPU ----------------------------------------------------------------------------------

def _require_cublas() -> None:
    ok, why = cublas_support(CUDA)
    if torch.cuda.get_device_capability(CUDA)[0] != 9:
        pytest.skip(f"cuBLAS blockwise scaling is SM90 only: {why}")
    assert ok, why  # on Hopper it must run: say why not


# (tokens, out, in): qwen3-30b-a3b's qkv and o_proj, GLM-5's o_proj K, T not a multiple of 4
# (rows padded), K / 128 = 3 and 9 (the weight scales padded to 4 K blocks), 1 token
CUBLAS_SHAPES = [(1024, 5120, 2048), (64, 2048, 4096), (7, 6144, 16384), (5, 256, 384),
                 (33, 1024, 1152), (1, 2048, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "n", "k"), CUBLAS_SHAPES)
def test_gpu_cublas_linear_matches_the_reference(t: int, n: int, k: int) -> None:
    _require_cublas()
    x, w = _data(t, n, k, device="cuda")
    wq, ws = quantize_blockwise(w)
    x = x.to(torch.bfloat16)
    if cublas_unfit(n, k, 128) is not None:
        pytest.skip(cublas_unfit(n, k, 128))  # K blocks to pad on a torch without F.scaled_mm
    out = fp8_linear_cublas(x, wq, ws)
    ref = w8a8_linear_ref(x.float(), wq, ws)
    assert out.shape == (t, n) and out.dtype == torch.bfloat16
    assert_matches_reference(out, ref)
    want = "cublas" if t >= fp8_cublas.AUTO_CUBLAS_MIN_TOKENS else "triton"  # auto's choice
    assert choose_fp8_backend(t, n, k, 128, x.device) == want


@pytest.mark.gpu
def test_gpu_cublas_layout_of_the_quantizer_equals_the_reference_bytes() -> None:
    x, _ = _data(4097, 1, 7168, device="cuda")
    x = x.to(torch.bfloat16)
    q, s = quantize_activations_triton(x, pad_rows_to=4, mn_major_scales=True)
    q_ref, s_ref = quantize_activations(x)
    assert q.shape == (4100, 7168) and s.stride() == (1, 4100)
    assert torch.equal(s[:4097], s_ref)
    assert torch.equal(q[:4097].view(torch.uint8), q_ref.view(torch.uint8))
    assert not q[4097:].view(torch.uint8).any()


@pytest.mark.gpu
def test_gpu_cublas_linear_in_a_cuda_graph() -> None:
    _require_cublas()
    x, w = _data(510, 1024, 2048, device="cuda")  # 510 rows: padded to 512 in the graph
    wq, ws = quantize_blockwise(w)
    x = x.to(torch.bfloat16)
    bias = torch.linspace(-1, 1, 1024, device="cuda").to(torch.bfloat16)
    expected = fp8_linear(x, wq, ws, bias, backend="cublas")  # probes and compiles outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, wq, ws, bias, backend="cublas")
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, wq, ws, bias, backend="cublas"))
    assert not torch.equal(out, expected)
    assert_matches_reference(out, w8a8_linear_ref(x.float(), wq, ws, bias=bias.float()))
