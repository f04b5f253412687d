"""The float8 e4m3 KV cache (the engine's kv_cache_dtype="fp8").

- The write rule (paged.to_cache_dtype): a value in the model's dtype, clamped to +-448, cast
  to e4m3 by round-to-nearest-even; `write_kv` applies it, and the fused q/k norm + RoPE + K/V
  write (qk_rope_kv_triton) stores the same bytes as the unfused path, values past 448 included.
- The reads: the torch reference and the Triton decode / prefill kernels over an e4m3 cache
  equal attention over that cache converted to the query's dtype (what the cache holds, exactly
  representable there), and differ from attention over the unquantized values (so the e4m3
  path really ran). Unwritten slots of the pool are NaN: reading one poisons the output.

- MLA's latent cache: the fused latent norm + RoPE + write stores the unfused bytes, and the
  absorbed Triton MLA reads an e4m3 latent cache as the reference does.

CPU through Triton's interpreter (fp32, fp16 queries); the GPU with bf16 queries.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.kernels.attention.metadata import build_attention_metadata
from moeserve.kernels.attention.mla.absorbed_triton import mla_attention_triton
from moeserve.kernels.attention.mla.reference import mla_attention_ref
from moeserve.kernels.attention.mla.rope_cache_triton import (
    mla_rope_cache_ref,
    mla_rope_cache_triton,
)
from moeserve.kernels.attention.paged import (
    FP8_MAX,
    paged_attention_ref,
    to_cache_dtype,
    write_kv,
)
from moeserve.kernels.attention.paged_triton import paged_attention_triton
from moeserve.kernels.attention.qk_rope_kv_triton import qk_rope_kv_ref, qk_rope_kv_triton
from tests.kernels.attention import test_mla_rope_cache_triton as mla_cases
from tests.kernels.attention.test_paged_attention_triton import MIXED, Step, make_step
from tests.kernels.attention.test_qk_rope_kv_triton import ODD, QWEN, exact_norm_case, make_case

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_to_cache_dtype_saturates_and_rounds_to_nearest() -> None:
    x = torch.tensor([0.0, 1.0, -1.0625, 0.3, 300.0, 448.0, 449.0, 1e4, -1e6])
    got = to_cache_dtype(x, FP8)
    assert got.dtype == FP8
    # 1.0625 is halfway between e4m3's 1.0 and 1.125 (3 mantissa bits): to even, 1.0
    assert got.float().tolist() == pytest.approx(
        [0.0, 1.0, -1.0, 0.3125, 288.0, 448.0, 448.0, FP8_MAX, -FP8_MAX])
    assert to_cache_dtype(x, torch.float32) is x  # the model's dtype: unchanged


def test_write_kv_stores_the_rule_into_an_fp8_cache() -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 5, 2, 16, generator=gen) * 300  # some past +-448
    cache = torch.zeros(2, 4, 4, 2, 16, dtype=FP8)
    slots = torch.tensor([3, 9, 0, 15, 6])
    write_kv(k, v, cache, slots)
    flat = cache.view(2, -1, 2, 16)
    assert torch.equal(flat[0, slots].view(torch.uint8), to_cache_dtype(k, FP8).view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), to_cache_dtype(v, FP8).view(torch.uint8))
    assert (flat[0, slots].float().abs().max() == FP8_MAX).item()


def fp8_step(step: Step) -> tuple[Step, Step]:
    """The step with its cache in e4m3, and the same step over that cache converted back to
    the query's dtype (what the kernels must attend over). NaN slots stay NaN."""
    cache = step.kv_cache.to(FP8)
    return (Step(step.q, cache, step.meta, step.scale),
            Step(step.q, cache.to(step.q.dtype), step.meta, step.scale))


def check_fp8_reads(step: Step) -> None:
    quant, dequant = fp8_step(step)
    tol = TOL[step.q.dtype]
    want = paged_attention_ref(dequant.q, dequant.kv_cache, dequant.meta, dequant.scale)
    ref = paged_attention_ref(quant.q, quant.kv_cache, quant.meta, quant.scale)
    got = paged_attention_triton(quant.q, quant.kv_cache, quant.meta, quant.scale)
    assert got.dtype == step.q.dtype and not got.isnan().any()
    # the same values, the same ops: equal on CPU; on CUDA SDPA's cuDNN attention gave one
    # element of 262,144 a bf16 ulp apart (H200, gpu_c432eb0/call6), so within one ulp there
    same = 0 if step.q.device.type == "cpu" else torch.finfo(step.q.dtype).eps
    torch.testing.assert_close(ref, want, atol=0, rtol=same)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # e4m3 really ran: the kernel's output is nearer attention over the rounded cache than
    # over the unrounded one (the rounding's error is ~10x a bf16 kernel's own)
    unquantized = paged_attention_ref(step.q, step.kv_cache, step.meta, step.scale)
    assert ((got.float() - want.float()).abs().max()
            < (got.float() - unquantized.float()).abs().max())


# ---------------------------------------------------------------- CPU, Triton's interpreter

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_reads_mixed_step(dtype: torch.dtype) -> None:
    check_fp8_reads(make_step(*MIXED, dtype=dtype))


def test_fp8_cache_reads_split_decode() -> None:
    check_fp8_reads(make_step([700, 3, 290], [1, 1, 1], block_size=8))


def e4m3_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor's bytes with -0.0 (0x80) as +0.0: the checks below compare values as
    torch.equal does in the model's dtype, where the sign of an exact zero is the compiler's
    (on the H200 the fused RoPE's exact zeros and torch's differ in sign, both ways, in 193 of
    the exactly-normed case's bytes: the same value in every dot)."""
    raw = cache.view(torch.uint8)
    return torch.where(raw == 0x80, torch.zeros_like(raw), raw)


def check_fused_write_fp8(case) -> None:
    """The fused write into an e4m3 cache stores the unfused path's bytes, with v scaled past
    448 so that the saturation runs too; q is the same as well."""
    h, kvh = case.heads
    d = case.kv_cache.shape[-1]
    case.qkv[:, (h + kvh) * d:] *= 400
    cache = case.kv_cache.to(FP8)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = qk_rope_kv_ref(*case.args(want_cache))
    got = qk_rope_kv_triton(*case.args(got_cache))
    assert torch.equal(got, want)
    assert torch.equal(e4m3_bytes(got_cache), e4m3_bytes(want_cache))
    assert got_cache.float().abs().max().item() == FP8_MAX


@pytest.mark.parametrize("shape", [QWEN, ODD])
def test_fused_write_into_fp8_equals_the_unfused_one(shape: tuple[int, int, int]) -> None:
    # Mixtral-like (no q/k norm) and exactly-normed Qwen3-like heads: every value the same in
    # the model's dtype, so the same e4m3 bytes
    for case in (make_case(7, torch.float16, shape, norm=False, device="cpu"),
                 exact_norm_case(torch.float16, shape)):
        check_fused_write_fp8(case)


def test_fused_write_rounds_every_half_value_as_torch_does() -> None:
    # the values run through v, which the kernel stores as loaded: ties, carries into the next
    # binade (1.986 -> 2), subnormals, signed zeros and values past 448, every fp16 pattern
    # between 2^-12 and 1,024 (Triton's interpreter gets its own e4m3 cast wrong on several)
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = bits[bits.isfinite() & ((bits.abs() >= 2 ** -12) & (bits.abs() <= 1024)
                                     | (bits == 0))]
    h, kvh, d = QWEN
    per_token = kvh * d
    t = -(-values.numel() // per_token)
    case = make_case(t, torch.float16, QWEN, norm=False, device="cpu")
    v = torch.zeros(t * per_token, dtype=torch.float16)
    v[:values.numel()] = values
    case.qkv[:, (h + kvh) * d:] = v.view(t, per_token)
    cache = case.kv_cache.to(FP8)
    qk_rope_kv_triton(*case.args(cache))
    stored = cache[1].view(-1, kvh, d)[case.slot_mapping].reshape(-1)[:values.numel()]
    assert torch.equal(stored.view(torch.uint8), to_cache_dtype(values, FP8).view(torch.uint8))


def check_fused_latent_write_fp8(case) -> None:
    """MLA: the fused latent norm + RoPE + write into an e4m3 cache stores the unfused path's
    bytes (exactly-normed latents, so every value is the same in the model's dtype), with the
    norm's weight scaled so that the saturation runs too; q_rope, cos and sin the same."""
    with torch.no_grad():
        case.weight *= 300
    kept = case.slots >= 0
    case = dataclasses.replace(case, slots=case.slots[kept], a=case.a[kept], q=case.q[kept],
                               positions=case.positions[kept])
    cache = case.cache.to(FP8)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = mla_rope_cache_ref(*case.args(want_cache))
    got = mla_rope_cache_triton(*case.args(got_cache))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(e4m3_bytes(got_cache), e4m3_bytes(want_cache))
    assert got_cache.float().abs().max().item() == FP8_MAX


@pytest.mark.parametrize("layout", ["v3", "odd"])
@pytest.mark.parametrize("interleaved", (True, False), ids=("interleaved", "half"))
def test_fused_latent_write_into_fp8_equals_the_unfused_one(layout: str,
                                                            interleaved: bool) -> None:
    check_fused_latent_write_fp8(mla_cases.exact_norm_case(torch.float16, layout, interleaved))


def test_mla_triton_reads_an_fp8_latent_cache() -> None:
    # absorbed MLA, decode and prefill rows, over an e4m3 latent cache against the reference
    # over that cache read back in the queries' dtype
    gen = torch.Generator().manual_seed(0)
    rank, rope_dim, heads, block = 32, 16, 4, 4
    computed, scheduled = [5, 17, 0, 12], [1, 1, 9, 7]
    seq = [c + n for c, n in zip(computed, scheduled, strict=True)]
    per_row = [-(-n // block) for n in seq]
    ids = (torch.randperm(sum(per_row) + 3, generator=gen) + 1).tolist()
    tables = [ids[sum(per_row[:i]):sum(per_row[:i + 1])] for i in range(len(seq))]
    cache = torch.randn(sum(per_row) + 4, block, rank + rope_dim, generator=gen).to(FP8)
    meta = build_attention_metadata(computed, scheduled, tables, block, "cpu")
    q = torch.randn(sum(scheduled), heads, rank + rope_dim, generator=gen)
    scale = (rank + rope_dim) ** -0.5
    got = mla_attention_triton(q, cache, meta, scale, rank)
    want = mla_attention_ref(q, cache.float(), meta, scale, rank)
    torch.testing.assert_close(mla_attention_ref(q, cache, meta, scale, rank), want,
                               atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_write_refuses_another_cache_dtype() -> None:
    case = make_case(3, torch.float16, ODD, norm=False, device="cpu")
    with pytest.raises(ValueError, match="kv_cache torch.bfloat16 must be qkv's"):
        qk_rope_kv_triton(*case.args(case.kv_cache.to(torch.bfloat16)))


def test_triton_read_refuses_another_cache_dtype() -> None:
    step = make_step(*MIXED, dtype=torch.float16)
    with pytest.raises(ValueError, match="is neither q's"):
        paged_attention_triton(step.q, step.kv_cache.to(torch.bfloat16), step.meta, step.scale)


# ---------------------------------------------------------------- GPU (bf16)

@pytest.mark.gpu
def test_gpu_fp8_cache_reads_bf16() -> None:
    for computed, scheduled in (MIXED, ([4000] * 8 + [100] * 56, [1] * 64),
                                ([0, 2048], [2048, 1024])):
        check_fp8_reads(make_step(computed, scheduled, block_size=16, num_kv_heads=4, group=8,
                                  head_dim=128, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
def test_gpu_fused_write_into_fp8_bf16() -> None:
    for case in (make_case(300, torch.bfloat16, QWEN, norm=False, device="cuda"),
                 exact_norm_case(torch.bfloat16, QWEN, device="cuda")):
        check_fused_write_fp8(case)


@pytest.mark.gpu
def test_gpu_fused_latent_write_into_fp8_bf16() -> None:
    for interleaved in (True, False):
        check_fused_latent_write_fp8(mla_cases.exact_norm_case(
            torch.bfloat16, "v3", interleaved, t=300, device="cuda"))
