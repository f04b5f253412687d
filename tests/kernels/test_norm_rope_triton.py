"""Triton RMSNorm (with and without the fused residual add) and RoPE against their torch
references, at qwen3-30b-a3b's shapes (hidden 2048; 32 q / 4 kv heads of 128, split from the
fused qkv output as strided views): CPU through Triton's interpreter (fp32, fp16), the GPU in
bf16 (with one case inside a CUDA graph). Partial rotary (GLM-4.5: head_dim 128, rotary 64;
and head_dim 16, rotary 8) against transformers' glm4_moe formula written out here.

Tolerances (what the kernels promise):
  * the residual sum, and RoPE in every dtype: bit exact (the same roundings as torch's ops);
  * RMSNorm: the fp32 sum of squares runs in another order (and rsqrt may differ), a few fp32
    ulps of y: fp32 to rtol 1e-5; in half dtypes the rounding flips by one ulp of the dtype on
    at most MAX_FLIPS of the elements (measured in the interpreter: fp16 ~3e-5 at T=300).
Without a GPU, tests/conftest.py turns Triton's interpreter on before anything imports triton.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.norm_rope.rmsnorm_triton import rms_norm_ref, rms_norm_triton
from moeserve.kernels.norm_rope.rope_triton import rope_ref, rope_triton
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rope import RotaryEmbedding, _cos_sin_table

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS = 2048, 32, 4, 128, 1e-6
MAX_POSITION, THETA = 40960, 1e6
MAX_FLIPS = 1e-3  # fraction of half-precision elements allowed one ulp off in RMSNorm
NORM_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.float16: dict(rtol=2e-3, atol=1e-5),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
CPU_DTYPES = (torch.float32, torch.float16)
TOKENS = (1, 7, 300)
PARTIAL = ((32, 4, 128, 64), (6, 2, 16, 8))  # (H, KVH, head_dim, rotary_dim)
PARTIAL_IDS = ("glm45", "tiny")


def qkv_views(t: int, dtype: torch.dtype, device: str, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) * D] and its q [T, H, D], k [T, KVH, D] views (as layers/attention)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen) * 2).to(dtype)
    qkv = qkv.to(device)
    q = qkv[:, :HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
    return qkv, q, k


def norm_inputs(t: int, d: int, dtype: torch.dtype, device: str, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=gen) * 3).to(dtype).to(device)  # [T, D]
    residual = (torch.randn(t, d, generator=gen) * 10).to(dtype).to(device)  # [T, D]
    weight = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(device)  # [D]
    return x, residual, weight


def assert_norm_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, **NORM_TOL[out.dtype])
    if out.dtype != torch.float32:
        flips = (out != expected).float().mean().item()
        assert flips <= MAX_FLIPS, f"{flips:.2e} of the elements differ"


def check_rms_norm(t: int, dtype: torch.dtype, device: str) -> None:
    x, residual, weight = norm_inputs(t, HIDDEN, dtype, device, seed=t)
    assert_norm_close(rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    out, new_residual = rms_norm_triton(x, weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(x, weight, EPS, residual)
    assert torch.equal(new_residual, expected_residual)  # the add is bit exact
    assert_norm_close(out, expected)


def check_rms_norm_parts(t: int, dtype: torch.dtype, device: str, parts: int = 8) -> None:
    """x [T, S, D] with residual [T, D] (a MoE layer's k weighted rows): the norm adds x.sum(1).
    The fp32 sum may add the parts in another order than torch's: a rare one-ulp difference
    in the new residual, none in fp32 beyond rounding."""
    _, residual, weight = norm_inputs(t, HIDDEN, dtype, device, seed=t)
    gen = torch.Generator().manual_seed(t + 1)
    x = (torch.randn(t, parts, HIDDEN, generator=gen) * 0.5).to(dtype).to(device)
    out, new_residual = rms_norm_triton(x, weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(x, weight, EPS, residual)
    assert expected_residual.shape == (t, HIDDEN)
    assert torch.equal(expected_residual, residual + x.sum(1))  # the reference: torch's ops
    assert new_residual.shape == out.shape == (t, HIDDEN)
    torch.testing.assert_close(new_residual, expected_residual, **NORM_TOL[dtype])
    flips = (new_residual != expected_residual).float().mean().item()
    assert flips <= MAX_FLIPS, f"{flips:.2e} of the residual elements differ"
    torch.testing.assert_close(out, expected, **NORM_TOL[dtype])


def check_qk_norm(t: int, dtype: torch.dtype, device: str) -> None:
    qkv, q, k = qkv_views(t, dtype, device, seed=t)
    before = qkv.clone()
    _, _, weight = norm_inputs(1, HEAD_DIM, dtype, device, seed=1)
    for x in (q, k):  # strided views, read in place
        assert t == 1 or not x.is_contiguous()
        assert_norm_close(rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    assert torch.equal(qkv, before)  # inputs untouched


def check_rope(t: int, dtype: torch.dtype, device: str) -> None:
    qkv, q, k = qkv_views(t, dtype, device, seed=t)
    cos, sin = _cos_sin_table(HEAD_DIM, MAX_POSITION, THETA, torch.device(device))
    gen = torch.Generator().manual_seed(t)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=gen).to(device)  # [T]
    positions[0] = MAX_POSITION - 1
    expected_q, expected_k = rope_ref(positions, q, k, cos, sin)
    out_q, out_k = rope_triton(positions, q, k, cos, sin)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    q_in, k_in = rope_triton(positions, q, k, cos, sin, inplace=True)  # writes into qkv
    assert q_in.data_ptr() == q.data_ptr() and k_in.data_ptr() == k.data_ptr()
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def hf_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """transformers' default inv_freq over the rotary dims (glm4_moe's
    compute_default_rope_parameters with dim = head_dim * partial_rotary_factor)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def hf_partial_rope(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """transformers' glm4_moe apply_rotary_pos_emb on x [T, H, D], tables [P, R], R <= D:
    x_rot, x_pass = x[..., :R], x[..., R:]; cat(x_rot * cos + rotate_half(x_rot) * sin,
    x_pass), with cos/sin cast to x's dtype first (HF's cos.to(x.dtype))."""
    c = cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, R]
    s = sin[positions].to(x.dtype).unsqueeze(1)
    r = c.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., :r // 2], x_rot[..., r // 2:]
    embed = (x_rot * c) + (torch.cat((-x2, x1), dim=-1) * s)
    return torch.cat([embed, x_pass], dim=-1)


def check_partial_rope(t: int, dtype: torch.dtype, shape: tuple[int, int, int, int],
                       device: str) -> None:
    """rope_triton (out of place and in place) and rope_ref on strided q/k views of a fused qkv
    row, with tables [P, R] narrower than the head: bit exact against HF's formula."""
    h, kvh, d, r = shape
    max_position, theta = (MAX_POSITION, THETA) if d == HEAD_DIM else (512, 1e4)
    gen = torch.Generator().manual_seed(t)
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=gen) * 2).to(dtype).to(device)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    cos, sin = _cos_sin_table(r, max_position, theta, torch.device(device))
    assert cos.shape == sin.shape == (max_position, r)
    positions = torch.randint(0, max_position, (t,), generator=gen).to(device)
    positions[0] = max_position - 1
    want_q, want_k = hf_partial_rope(positions, q, cos, sin), hf_partial_rope(positions, k, cos,
                                                                               sin)
    assert torch.equal(want_q[..., r:], q[..., r:]) and not torch.equal(want_q, q)
    ref_q, ref_k = rope_ref(positions, q, k, cos, sin)
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)
    out_q, out_k = rope_triton(positions, q, k, cos, sin)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)
    rest = qkv[:, (h + kvh) * d:].clone()
    q_in, k_in = rope_triton(positions, q, k, cos, sin, inplace=True)  # writes into qkv
    assert q_in.data_ptr() == q.data_ptr() and k_in.data_ptr() == k.data_ptr()
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (h + kvh) * d:], rest)  # v untouched


# ---- CPU, through Triton's interpreter ----

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm_hidden_rows(t: int, dtype: torch.dtype) -> None:
    check_rms_norm(t, dtype, "cpu")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm_adds_parts_to_the_residual(t: int, dtype: torch.dtype) -> None:
    check_rms_norm_parts(t, dtype, "cpu")


def test_rms_norm_parts_one_part_and_strided_parts() -> None:
    """One part (a backend that adds its k rows itself: [T, 1, D]) is x itself, bit exact; parts
    read through a strided view ([T, S, D] sliced out of a wider tensor)."""
    torch.manual_seed(0)
    weight = torch.randn(64)
    x, residual = torch.randn(9, 1, 64), torch.randn(9, 64)
    out, new_residual = rms_norm_triton(x, weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(x[:, 0], weight, EPS, residual)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, **NORM_TOL[torch.float32])
    wide = torch.randn(9, 6, 64)
    out, new_residual = rms_norm_triton(wide[:, 1:5], weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(wide[:, 1:5], weight, EPS, residual)
    torch.testing.assert_close(new_residual, expected_residual, **NORM_TOL[torch.float32])
    torch.testing.assert_close(out, expected, **NORM_TOL[torch.float32])
    with pytest.raises(ValueError, match="parts"):
        rms_norm_triton(torch.randn(9, 4, 64), weight, EPS, torch.randn(8, 64))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm_per_head_on_qkv_views(t: int, dtype: torch.dtype) -> None:
    check_qk_norm(t, dtype, "cpu")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_rope_bit_exact_on_qkv_views(t: int, dtype: torch.dtype) -> None:
    check_rope(t, dtype, "cpu")


@pytest.mark.parametrize("shape", PARTIAL, ids=PARTIAL_IDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_partial_rope_matches_hf_formula(t: int, dtype: torch.dtype,
                                         shape: tuple[int, int, int, int]) -> None:
    check_partial_rope(t, dtype, shape, "cpu")


@pytest.mark.parametrize("rotary_dim", (8, 16))
def test_rotary_embedding_tables_and_partial_rotary(rotary_dim: int) -> None:
    """RotaryEmbedding(head_dim 16, rotary_dim): tables [P, R] from HF's inv_freq over R (R = D
    by default, as before), and the layer's CPU forward is HF's partial formula."""
    default = RotaryEmbedding(16, 512, 1e4)
    assert default.rotary_dim == 16 and default.cos.shape == (512, 16)
    rope = RotaryEmbedding(16, 512, 1e4, rotary_dim=rotary_dim)
    assert rope.cos.shape == rope.sin.shape == (512, rotary_dim)
    freqs = torch.arange(512, dtype=torch.float)[:, None] * hf_inv_freq(rotary_dim, 1e4)[None]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
    assert torch.equal(rope.cos, emb.cos()) and torch.equal(rope.sin, emb.sin())
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    positions = torch.tensor([0, 3, 100, 511, 7])
    out_q, out_k = rope(positions, q, k)
    assert torch.equal(out_q, hf_partial_rope(positions, q, rope.cos, rope.sin))
    assert torch.equal(out_k, hf_partial_rope(positions, k, rope.cos, rope.sin))
    for bad in (0, 7, 18):
        with pytest.raises(ValueError, match="rotary_dim"):
            RotaryEmbedding(16, 512, 1e4, rotary_dim=bad)


def test_rms_norm_odd_sizes_and_layouts() -> None:
    """D not a power of two (masked columns), rows not a multiple of the block, a 4-D input, a
    non-unit last stride, a 1-D input, and fp32 weights on fp16 activations (fp32 out, as HF)."""
    torch.manual_seed(0)
    weight = torch.randn(100)
    for x in (torch.randn(5, 3, 100), torch.randn(2, 3, 4, 100),
              torch.randn(100, 6).t(), torch.randn(100)):
        assert_norm_close(rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    x, residual = torch.randn(5, 17, 100).half(), torch.randn(5, 17, 100).half()
    out, new_residual = rms_norm_triton(x, weight, EPS, residual)
    expected, expected_residual = rms_norm_ref(x, weight, EPS, residual)
    assert out.dtype == torch.float32 and torch.equal(new_residual, expected_residual)
    # y is rounded to fp16 before the fp32 weight: one fp16 ulp where that rounding flips
    torch.testing.assert_close(out, expected, **NORM_TOL[torch.float16])
    assert (out != expected).float().mean().item() <= MAX_FLIPS


def test_rope_odd_head_counts() -> None:
    """Head counts that are not powers of two (masked heads), head_dim 64, int32 positions."""
    torch.manual_seed(0)
    q, k = torch.randn(9, 6, 64), torch.randn(9, 3, 64)
    cos, sin = _cos_sin_table(64, 512, 1e4, torch.device("cpu"))
    positions = torch.randint(0, 512, (9,), dtype=torch.int32)
    out = rope_triton(positions, q, k, cos, sin)
    expected = rope_ref(positions.long(), q, k, cos, sin)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert not torch.equal(out[0], q)


def test_launchers_reject_bad_inputs() -> None:
    x, q, k = torch.randn(4, 64), torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = _cos_sin_table(16, 32, 1e4, torch.device("cpu"))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, torch.ones(64), EPS, torch.randn(4, 64).half())
    with pytest.raises(ValueError, match="shapes"):
        rope_triton(torch.arange(3), q, k, cos, sin)
    with pytest.raises(ValueError, match="cos"):
        rope_triton(torch.arange(2), q, k, cos.double(), sin)
    wide, _ = _cos_sin_table(18, 32, 1e4, torch.device("cpu"))  # wider than the head
    with pytest.raises(ValueError, match="R even and <= head_dim"):
        rope_triton(torch.arange(2), q, k, wide, wide)
    with pytest.raises(ValueError, match="R even"):
        rope_triton(torch.arange(2), q, k, cos[:, :7].contiguous(), sin[:, :7].contiguous())


def test_cpu_layers_keep_the_torch_ops() -> None:
    """On CPU the layers run the reference: the fused call equals the unfused HF ops bitwise."""
    torch.manual_seed(0)
    norm = RMSNorm(64, EPS, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x, residual = torch.randn(7, 64).bfloat16(), torch.randn(7, 64).bfloat16()
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, residual + x) and torch.equal(out, norm(residual + x))
    s = residual + x
    s32 = s.float()
    hf = norm.weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16()
    assert torch.equal(out, hf)


# ---- GPU, bf16 ----

@pytest.mark.gpu
@pytest.mark.parametrize("t", (1, 7, 300, 4096))
def test_gpu_bf16(t: int) -> None:
    check_rms_norm(t, torch.bfloat16, "cuda")
    check_rms_norm_parts(t, torch.bfloat16, "cuda")
    check_qk_norm(t, torch.bfloat16, "cuda")
    check_rope(t, torch.bfloat16, "cuda")
    for shape in PARTIAL:
        check_partial_rope(t, torch.bfloat16, shape, "cuda")


@pytest.mark.gpu
def test_gpu_layers_use_triton_and_match_reference() -> None:
    norm = RMSNorm(HIDDEN, EPS, torch.bfloat16, "cuda")
    x, residual, weight = norm_inputs(64, HIDDEN, torch.bfloat16, "cuda")
    with torch.no_grad():
        norm.weight.copy_(weight)
    out, new_residual = norm(x, residual)
    triton_out, triton_residual = rms_norm_triton(x, weight, EPS, residual)
    assert torch.equal(out, triton_out) and torch.equal(new_residual, triton_residual)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, THETA, "cuda")
    _, q, k = qkv_views(64, torch.bfloat16, "cuda")
    positions = torch.arange(64, device="cuda") * 600
    out_q, out_k = rope(positions, q, k)
    expected_q, expected_k = rope_ref(positions, q, k, rope.cos, rope.sin)
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    partial = RotaryEmbedding(HEAD_DIM, MAX_POSITION, THETA, "cuda", rotary_dim=HEAD_DIM // 2)
    out_q, out_k = partial(positions, q, k)
    assert torch.equal(out_q, hf_partial_rope(positions, q, partial.cos, partial.sin))
    assert torch.equal(out_k, hf_partial_rope(positions, k, partial.cos, partial.sin))


@pytest.mark.gpu
def test_gpu_norm_and_rope_in_cuda_graph() -> None:
    """Captured once (no host sync allowed), replayed on new inputs written in place."""
    t = 256
    x, residual, weight = norm_inputs(t, HIDDEN, torch.bfloat16, "cuda")
    qkv, q, k = qkv_views(t, torch.bfloat16, "cuda")
    _, _, qk_weight = norm_inputs(1, HEAD_DIM, torch.bfloat16, "cuda", seed=1)
    cos, sin = _cos_sin_table(HEAD_DIM, MAX_POSITION, THETA, torch.device("cuda"))
    positions = torch.zeros(t, dtype=torch.long, device="cuda")

    def step() -> tuple[torch.Tensor, ...]:
        out, new_residual = rms_norm_triton(x, weight, EPS, residual)
        q_out, k_out = rope_triton(positions, rms_norm_triton(q, qk_weight, EPS),
                                   rms_norm_triton(k, qk_weight, EPS), cos, sin)
        return out, new_residual, q_out, k_out

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            outs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(2):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        qkv.copy_(torch.randn_like(qkv))
        positions.copy_(torch.randint(0, MAX_POSITION, (t,), device="cuda"))
        graph.replay()
        expected = step()
        for got, want in zip(outs, expected):
            assert torch.equal(got, want), f"replay {seed} differs from eager"
