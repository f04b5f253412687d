"""The fused q/k norm + RoPE + K/V write (kernels/attention/qk_rope_kv_triton.py) against the
unfused reference (rms_norm_ref per head -> rope_ref -> write_kv into a copy of the cache), at
qwen3-30b-a3b's attention shape (32 q / 4 kv heads of 128) and an odd one (6 / 2 of 64): CPU
through Triton's interpreter (fp32, fp16), the GPU in bf16 (with one case in a CUDA graph).

Tolerances (what the kernel promises):
  * without q/k norm (Mixtral): q and the cache bit exact;
  * with q/k norm: the norm's fp32 sum of squares runs in another order (and rsqrt may differ),
    as in rmsnorm_triton: fp32 within NORM_TOL; in half dtypes a normed value's rounding flips
    by one ulp on at most MAX_FLIPS of the elements, and each flipped value moves the two RoPE
    outputs of its pair, so at most 2 * MAX_FLIPS of q / k differ, by at most NORM_TOL's rtol
    of the largest value (a flip before a cancelling sum is no longer small relative to its
    output). v is bit exact in every case.
  * RoPE and the write, given the same normed values: bit exact. Checked on inputs where the
    norm is exact in any order (values in {0, +-1, +-2} * 2^k, mean square a power of 4, eps
    0): the whole fused result then equals the reference bit for bit.
Partial rotary (GLM-4.5: 96 / 8 heads of 128 with rotary 64; and 6 / 2 of 16 with rotary 8):
against transformers' glm4_moe written out here (qk norm over the whole head, then RoPE on the
first rotary_dim dims, the rest passed through), to the same tolerances.
The interpreter rounds bf16 differently from CUDA and torch (it does for rope_triton too), so
bf16 runs on the GPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.paged import paged_attention_ref
from moeserve.kernels.attention.qk_rope_kv_triton import (
    qk_rope_kv_ref,
    qk_rope_kv_triton,
    split_qkv,
)
from moeserve.kernels.norm_rope.rope_triton import rope_ref
from moeserve.layers import attention as attention_module
from moeserve.layers.attention import Attention
from moeserve.layers.rope import _cos_sin_table
from moeserve.model_config import ModelConfig
from tests.kernels.test_norm_rope_triton import MAX_FLIPS, NORM_TOL, hf_partial_rope

QWEN, ODD = (32, 4, 128), (6, 2, 64)  # (H, KVH, D)
GLM45, TINY = (96, 8, 128), (6, 2, 16)  # partial rotary shapes, with rotary dims PARTIAL_DIM
PARTIAL_DIM = {128: 64, 16: 8}  # head_dim -> rotary_dim (GLM-4.5's partial_rotary_factor 0.5)
TABLES = {128: (40960, 1e6), 64: (4096, 1e4), 16: (512, 1e4)}  # head_dim -> (P, theta)
EPS, BLOCK_SIZE = 1e-6, 16
CPU_DTYPES = (torch.float32, torch.float16)
TOKENS = (1, 7, 300)


@dataclass
class Case:
    qkv: torch.Tensor  # [T, (H + 2 KVH) * D]
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [P, R] fp32 (R = D, or R < D: partial rotary)
    sin: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, BLOCK_SIZE, KVH, D], random (not zeros)
    slot_mapping: torch.Tensor  # [T] int64, distinct
    heads: tuple[int, int]  # (H, KVH)
    weights: tuple[torch.Tensor | None, torch.Tensor | None]  # q_norm, k_norm [D] or None

    def args(self, kv_cache: torch.Tensor, eps: float = EPS) -> tuple:
        return (self.qkv, self.positions, self.cos, self.sin, kv_cache, self.slot_mapping,
                *self.heads, *self.weights, eps)


def make_case(t: int, dtype: torch.dtype, shape: tuple[int, int, int], norm: bool,
              device: str, seed: int = 0, rotary_dim: int | None = None) -> Case:
    h, kvh, d = shape
    gen = torch.Generator().manual_seed(seed)
    max_position, theta = TABLES[d]
    cos, sin = _cos_sin_table(rotary_dim or d, max_position, theta, torch.device(device))
    qkv = (torch.randn(t, (h + 2 * kvh) * d, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, max_position, (t,), generator=gen)
    positions[0] = max_position - 1
    num_slots = 2 * t + 3 * BLOCK_SIZE  # room for untouched slots
    num_blocks = -(-num_slots // BLOCK_SIZE)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kvh, d, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:t]
    weights = (None, None)
    if norm:
        weights = tuple((1 + 0.3 * torch.randn(d, generator=gen)).to(dtype).to(device)
                        for _ in range(2))
    return Case(qkv.to(device), positions.to(device), cos, sin, kv_cache.to(device),
                slots.to(device), (h, kvh), weights)


def assert_close_after_norm(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The bound of the module docstring for values computed from normed ones."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    rtol = NORM_TOL[got.dtype]["rtol"]
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")
    if got.dtype != torch.float32:
        flips = (got != want).float().mean().item()
        assert flips <= 2 * MAX_FLIPS, f"{what}: {flips:.2e} of the elements differ"


def check_fused(case: Case, exact: bool, eps: float = EPS) -> None:
    """The kernel against the reference; exact: q and the cache bit for bit."""
    before, cache_before = case.qkv.clone(), case.kv_cache.clone()
    want_cache, got_cache = case.kv_cache.clone(), case.kv_cache.clone()
    want = qk_rope_kv_ref(*case.args(want_cache, eps))
    got = qk_rope_kv_triton(*case.args(got_cache, eps))
    assert torch.equal(case.qkv, before), "qkv was modified"
    assert got.is_contiguous() and got.shape == want.shape
    num_kv_heads, d = case.kv_cache.shape[-2:]
    k_got, v_got = got_cache.view(2, -1, num_kv_heads, d)  # [num_slots, KVH, D] each
    k_want, v_want = want_cache.view(2, -1, num_kv_heads, d)
    untouched = torch.ones(k_got.shape[0], dtype=torch.bool, device=got.device)
    untouched[case.slot_mapping] = False
    flat_before = cache_before.view(2, -1, num_kv_heads, d)
    assert torch.equal(got_cache.view(2, -1, num_kv_heads, d)[:, untouched],
                       flat_before[:, untouched]), "a slot outside slot_mapping was written"
    assert torch.equal(v_got, v_want)
    if exact:
        assert torch.equal(got, want) and torch.equal(k_got, k_want)
    else:
        assert_close_after_norm(got, want, "q")
        assert_close_after_norm(k_got[case.slot_mapping], k_want[case.slot_mapping], "k")


def exact_norm_case(dtype: torch.dtype, shape: tuple[int, int, int], t: int = 9,
                    max_exp: int = 2, device: str = "cpu", rotary_dim: int | None = None) -> Case:
    """Heads of values in {0, +-1, +-2} * 2^k (|k| <= max_exp) with mean square 4^k: the fp32
    sum of squares is exact in any order and rsqrt of a power of 4 is exact, so the normed
    values (eps 0) agree bit for bit and any difference would come from RoPE or the write."""
    h, kvh, d = shape
    case = make_case(t, dtype, shape, norm=True, device=device, seed=t, rotary_dim=rotary_dim)
    gen = torch.Generator().manual_seed(1)
    quads = torch.tensor([[1.0, 1, 1, 1], [2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 2]])  # sq sum 4
    heads = quads[torch.randint(0, 4, (t, h + 2 * kvh, d // 4), generator=gen)]  # [.., D/4, 4]
    signs = torch.randint(0, 2, heads.shape, generator=gen) * 2 - 1
    scale = 2.0 ** torch.randint(-max_exp, max_exp + 1, (t, h + 2 * kvh, 1, 1), generator=gen)
    case.qkv = (heads * signs * scale).reshape(t, -1).to(dtype).to(device)
    return case


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Glm4MoeRMSNorm.forward over the last dim (the whole head for q/k norm)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def hf_formula(case: Case, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and the cache after the step, as glm4_moe's attention computes q and k
    (q/k norm over all D dims when weights are given, then apply_rotary_pos_emb with tables
    [P, R]: R dims rotate, D - R pass through) and writes k, v at the token's slot."""
    h, kvh = case.heads
    d = case.kv_cache.shape[-1]
    t = case.qkv.shape[0]
    q = case.qkv[:, :h * d].reshape(t, h, d)
    k = case.qkv[:, h * d:(h + kvh) * d].reshape(t, kvh, d)
    v = case.qkv[:, (h + kvh) * d:].reshape(t, kvh, d)
    if case.weights[0] is not None:
        q, k = hf_rms_norm(q, case.weights[0], eps), hf_rms_norm(k, case.weights[1], eps)
    q = hf_partial_rope(case.positions, q, case.cos, case.sin)
    k = hf_partial_rope(case.positions, k, case.cos, case.sin)
    cache = case.kv_cache.clone()
    flat = cache.view(2, -1, kvh, d)  # [2, num_slots, KVH, D], a view of cache
    flat[0, case.slot_mapping], flat[1, case.slot_mapping] = k, v
    return q, cache


def check_partial(case: Case, exact: bool, eps: float = EPS) -> None:
    """The kernel and the reference chain against HF's formula (tables narrower than the head):
    the reference bit for bit; the kernel bit for bit when exact, else to the norm bound."""
    h, kvh = case.heads
    d, r = case.kv_cache.shape[-1], case.cos.shape[1]
    assert r < d
    want_q, want_cache = hf_formula(case, eps)
    ref_cache, got_cache = case.kv_cache.clone(), case.kv_cache.clone()
    assert torch.equal(qk_rope_kv_ref(*case.args(ref_cache, eps)), want_q)
    assert torch.equal(ref_cache, want_cache)
    before = case.qkv.clone()
    got = qk_rope_kv_triton(*case.args(got_cache, eps))
    assert torch.equal(case.qkv, before), "qkv was modified"
    assert got.is_contiguous() and got.shape == want_q.shape
    k_got, v_got = got_cache.view(2, -1, kvh, d)  # [num_slots, KVH, D] each
    k_want, v_want = want_cache.view(2, -1, kvh, d)
    assert torch.equal(v_got, v_want)
    untouched = torch.ones(k_got.shape[0], dtype=torch.bool, device=got.device)
    untouched[case.slot_mapping] = False
    assert torch.equal(k_got[untouched], k_want[untouched]), "a slot outside slot_mapping"
    if case.weights[0] is None:  # no norm: the pass dims are the input's, bit for bit
        q_in = case.qkv[:, :h * d].reshape(-1, h, d)
        assert torch.equal(got[..., r:], q_in[..., r:])
    if exact:
        assert torch.equal(got, want_q) and torch.equal(k_got, k_want)
    else:  # the norm bound, counting flips over q and k together (a 1-token k is 1k values)
        k_got, k_want = k_got[case.slot_mapping], k_want[case.slot_mapping]
        for part, what in ((slice(None, r), "rotary dims"), (slice(r, None), "pass dims")):
            assert_close_after_norm(torch.cat((got[..., part].flatten(),
                                               k_got[..., part].flatten())),
                                    torch.cat((want_q[..., part].flatten(),
                                               k_want[..., part].flatten())), f"q, k {what}")


# ---- CPU, through Triton's interpreter ----

@pytest.mark.parametrize("shape", (QWEN, ODD), ids=("qwen3", "odd"))
@pytest.mark.parametrize("norm", (False, True), ids=("no_norm", "qk_norm"))
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_matches_reference(t: int, dtype: torch.dtype, norm: bool,
                           shape: tuple[int, int, int]) -> None:
    check_fused(make_case(t, dtype, shape, norm, "cpu", seed=t), exact=not norm)


# eps 0: the masked (padding) heads of a block of 8 for 6 heads divide 0 by 0; never stored
@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:invalid value")
@pytest.mark.parametrize("shape", (QWEN, ODD), ids=("qwen3", "odd"))
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rope_and_write_bit_exact_given_the_same_normed_values(
        dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    check_fused(exact_norm_case(dtype, shape), exact=True, eps=0.0)


@pytest.mark.parametrize("shape", (GLM45, TINY), ids=("glm45", "tiny"))
@pytest.mark.parametrize("norm", (False, True), ids=("no_norm", "qk_norm"))
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_partial_rotary_matches_hf_formula(t: int, dtype: torch.dtype, norm: bool,
                                           shape: tuple[int, int, int]) -> None:
    case = make_case(t, dtype, shape, norm, "cpu", seed=t, rotary_dim=PARTIAL_DIM[shape[2]])
    check_partial(case, exact=not norm)


@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:invalid value")
@pytest.mark.parametrize("shape", (GLM45, TINY), ids=("glm45", "tiny"))
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_partial_rotary_bit_exact_given_the_same_normed_values(
        dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """The norm spans the whole head (rotary and pass dims): with exact-norm inputs the fused
    result is HF's bit for bit, which fails if the norm covered only the rotary dims."""
    case = exact_norm_case(dtype, shape, rotary_dim=PARTIAL_DIM[shape[2]])
    check_partial(case, exact=True, eps=0.0)


def test_empty_step_and_strided_qkv() -> None:
    """T = 0 launches nothing; qkv read through a row stride wider than its row."""
    case = make_case(5, torch.float32, ODD, norm=True, device="cpu")
    empty = make_case(5, torch.float32, ODD, norm=True, device="cpu")
    empty.qkv, empty.positions, empty.slot_mapping = (
        case.qkv[:0], case.positions[:0], case.slot_mapping[:0])
    cache = case.kv_cache.clone()
    assert qk_rope_kv_triton(*empty.args(cache)).shape == (0, 6, 64)
    assert torch.equal(cache, case.kv_cache)
    wide = torch.randn(5, case.qkv.shape[1] + 24)
    case.qkv = wide[:, 8:8 + case.qkv.shape[1]]  # [T, width], row stride width + 24
    check_fused(case, exact=False)


def test_padding_slots() -> None:
    """CUDA-graph padding rows all write the null block's slot 0 (duplicates: one of their
    values lands there, as with write_kv); a slot outside the cache is not written (write_kv
    would raise; the kernel cannot without a host sync). q is computed for every row."""
    case = make_case(6, torch.float16, ODD, norm=False, device="cpu")
    num_slots = case.kv_cache[0].numel() // (2 * 64)
    case.slot_mapping = torch.tensor([5, -1, num_slots, 0, 0, 0])
    cache = case.kv_cache.clone()
    q = qk_rope_kv_triton(*case.args(cache))
    q_in, k_in, v = split_qkv(case.qkv, 6, 2, 64)
    q_want, k_want = rope_ref(case.positions, q_in, k_in, case.cos, case.sin)
    assert torch.equal(q, q_want)
    k_cache, v_cache = cache.view(2, num_slots, 2, 64)
    assert torch.equal(k_cache[5], k_want[0]) and torch.equal(v_cache[5], v[0])
    assert any(torch.equal(k_cache[0], k_want[i]) for i in (3, 4, 5))
    assert any(torch.equal(v_cache[0], v[i]) for i in (3, 4, 5))
    before = case.kv_cache.view(2, num_slots, 2, 64)
    rest = torch.ones(num_slots, dtype=torch.bool)
    rest[[0, 5]] = False
    assert torch.equal(cache.view(2, num_slots, 2, 64)[:, rest], before[:, rest])


def test_rejects_bad_inputs() -> None:
    case = make_case(3, torch.float32, ODD, norm=True, device="cpu")
    cache = case.kv_cache.clone()

    def call(**change: object) -> None:
        args = dict(zip(("qkv", "positions", "cos", "sin", "kv_cache", "slot_mapping",
                         "num_heads", "num_kv_heads", "q_norm_weight", "k_norm_weight", "eps"),
                        case.args(cache)))
        qk_rope_kv_triton(**{**args, **change})

    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=case.qkv[:, :-64])
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        call(slot_mapping=case.slot_mapping.int())
    with pytest.raises(ValueError, match="positions must be integer"):
        call(positions=case.positions.float())
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=cache.half())
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=cache[:, :1].transpose(1, 2))
    with pytest.raises(ValueError, match="KV heads"):
        call(num_kv_heads=1)
    with pytest.raises(ValueError, match="or neither"):
        call(k_norm_weight=None)
    with pytest.raises(ValueError, match="q_norm_weight must be"):
        call(q_norm_weight=case.weights[0].half())
    with pytest.raises(ValueError, match="cos must be"):
        call(cos=case.cos.double())
    wide = torch.zeros(case.cos.shape[0], 66)  # wider than the head
    with pytest.raises(ValueError, match="R even and <= head_dim 64"):
        call(cos=wide, sin=wide)
    odd = torch.zeros(case.cos.shape[0], 31)
    with pytest.raises(ValueError, match="R even"):
        call(cos=odd, sin=odd)
    assert torch.equal(cache, case.kv_cache)


# ---- the layer ----

def attention_layer(qk_norm: bool, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Attention:
    """A Qwen3-style (qk_norm) or Mixtral-style layer with random weights and a bound cache."""
    arch = "Qwen3MoeForCausalLM" if qk_norm else "MixtralForCausalLM"
    cfg = ModelConfig(architecture=arch, vocab_size=64, hidden_size=96, num_layers=1,
                      num_heads=6, num_kv_heads=2, head_dim=64, intermediate_size=128,
                      qk_norm=qk_norm, max_position_embeddings=512)
    layer = Attention(0, cfg, paged_attention_ref, dtype, device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else torch.randn(p.shape, generator=gen) * 0.1)
    layer.kv_cache = torch.zeros(2, 8, BLOCK_SIZE, 2, 64, dtype=dtype, device=device)
    return layer


@pytest.mark.parametrize("qk_norm", (False, True))
def test_cpu_layer_keeps_the_torch_ops(qk_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the layer never calls the fused kernel; its result is the reference chain's."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused kernel ran on CPU")

    monkeypatch.setattr(attention_module, "qk_rope_kv_triton", refuse)
    layer = attention_layer(qk_norm)
    meta = build_attention_metadata([0, 5], [4, 1], [[1], [2]], BLOCK_SIZE, "cpu")
    hidden = torch.randn(5, 96)
    out = layer(meta.positions, hidden, meta)  # the whole forward: no fused call
    assert out.shape == (5, 96) and layer.kv_cache.abs().sum() > 0
    cache = torch.zeros_like(layer.kv_cache)
    qkv = torch.nn.functional.linear(hidden, layer.qkv_proj)
    weights = (layer.q_norm.weight, layer.k_norm.weight) if qk_norm else (None, None)
    want = qk_rope_kv_ref(qkv, meta.positions, layer.rotary.cos, layer.rotary.sin, cache,
                          meta.slot_mapping, 6, 2, *weights, EPS)
    got = layer._qk_rope_kv(meta.positions, qkv, meta.slot_mapping, fused=False)
    assert torch.equal(got, want) and torch.equal(layer.kv_cache, cache)


@pytest.mark.parametrize("qk_norm", (False, True))
def test_layer_fused_branch_matches_the_torch_branch(qk_norm: bool) -> None:
    """The branch the layer takes on CUDA, run here through the interpreter."""
    layer = attention_layer(qk_norm)
    positions = torch.tensor([0, 1, 2, 300, 511])
    slots = torch.tensor([16, 17, 18, 40, 100])
    qkv = torch.randn(5, (6 + 2 * 2) * 64)
    want = layer._qk_rope_kv(positions, qkv, slots, fused=False)
    want_cache = layer.kv_cache.clone()
    layer.kv_cache.zero_()
    got = layer._qk_rope_kv(positions, qkv, slots, fused=True)
    if qk_norm:
        assert_close_after_norm(got, want, "q")
        assert_close_after_norm(layer.kv_cache, want_cache, "cache")
    else:
        assert torch.equal(got, want) and torch.equal(layer.kv_cache, want_cache)


# ---- GPU, bf16 ----

@pytest.mark.gpu
@pytest.mark.parametrize("shape", (QWEN, ODD), ids=("qwen3", "odd"))
@pytest.mark.parametrize("norm", (False, True), ids=("no_norm", "qk_norm"))
@pytest.mark.parametrize("t", (1, 7, 300, 4096))
def test_gpu_bf16(t: int, norm: bool, shape: tuple[int, int, int]) -> None:
    check_fused(make_case(t, torch.bfloat16, shape, norm, "cuda", seed=t), exact=not norm)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", (GLM45, TINY), ids=("glm45", "tiny"))
@pytest.mark.parametrize("norm", (False, True), ids=("no_norm", "qk_norm"))
@pytest.mark.parametrize("t", (1, 7, 300, 4096))
def test_gpu_bf16_partial_rotary(t: int, norm: bool, shape: tuple[int, int, int]) -> None:
    case = make_case(t, torch.bfloat16, shape, norm, "cuda", seed=t,
                     rotary_dim=PARTIAL_DIM[shape[2]])
    check_partial(case, exact=not norm)


@pytest.mark.gpu
def test_gpu_partial_rotary_bit_exact_given_the_same_normed_values() -> None:
    """As test_gpu_rope_and_write_bit_exact_given_the_same_normed_values, partial rotary."""
    case = exact_norm_case(torch.bfloat16, GLM45, t=64, max_exp=0, device="cuda",
                           rotary_dim=64)
    check_partial(case, exact=True, eps=0.0)


@pytest.mark.gpu
def test_gpu_rope_and_write_bit_exact_given_the_same_normed_values() -> None:
    """As on CPU, in bf16, with mean squares of 1 only (tl.rsqrt is the GPU's approximate
    rsqrt: exact at 1.0, not promised at other powers of 4). Should this fail, check first
    whether rsqrt(1.0) is exact in both torch and Triton on this GPU."""
    check_fused(exact_norm_case(torch.bfloat16, QWEN, t=64, max_exp=0, device="cuda"),
                exact=True, eps=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", (False, True))
def test_gpu_layer_uses_the_fused_kernel(qk_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return qk_rope_kv_triton(*args, **kwargs)

    monkeypatch.setattr(attention_module, "qk_rope_kv_triton", counted)
    layer = attention_layer(qk_norm, "cuda", torch.bfloat16)
    meta = build_attention_metadata([0, 5], [4, 1], [[1], [2]], BLOCK_SIZE, "cuda")
    hidden = torch.randn(5, 96, device="cuda", dtype=torch.bfloat16)
    layer(meta.positions, hidden, meta)
    assert calls == [1]
    fused_cache = layer.kv_cache.clone()
    qkv = torch.nn.functional.linear(hidden, layer.qkv_proj)
    want = layer._qk_rope_kv(meta.positions, qkv, meta.slot_mapping, fused=False)
    want_cache = layer.kv_cache.clone()
    got = layer._qk_rope_kv(meta.positions, qkv, meta.slot_mapping, fused=True)
    assert torch.equal(layer.kv_cache, fused_cache)  # the forward's launch did the same
    if qk_norm:
        assert_close_after_norm(got, want, "q")
        assert_close_after_norm(fused_cache, want_cache, "cache")
    else:
        assert torch.equal(got, want) and torch.equal(fused_cache, want_cache)


@pytest.mark.gpu
def test_gpu_in_cuda_graph() -> None:
    """Captured once (no host sync allowed), replayed on new inputs written in place."""
    t = 256
    case = make_case(t, torch.bfloat16, QWEN, norm=True, device="cuda")
    graph_cache = case.kv_cache.clone()
    qk_rope_kv_triton(*case.args(graph_cache))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            q_graph = qk_rope_kv_triton(*case.args(graph_cache))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        case.qkv.copy_(torch.randn(case.qkv.shape, device="cuda", generator=gen))
        case.positions.copy_(torch.randint(0, TABLES[128][0], (t,), device="cuda",
                                           generator=gen))
        case.slot_mapping.copy_(torch.randperm(graph_cache[0].numel() // (4 * 128),
                                               device="cuda", generator=gen)[:t])
        eager_cache = graph_cache.clone()
        graph.replay()
        q_eager = qk_rope_kv_triton(*case.args(eager_cache))
        assert torch.equal(q_graph, q_eager), f"replay {seed}: q differs from eager"
        assert torch.equal(graph_cache, eager_cache), f"replay {seed}: cache differs"
