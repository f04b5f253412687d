"""The DSA indexer's fused key write and query RoPE (kernels/attention/dsa/indexer_rope_triton.py)
against their torch references (the ops layers/dsa.py's Indexer runs unfused): on CPU under
Triton's interpreter in fp32, fp16 and bf16, both RoPE layouts; the query bit exact, the key
bit exact in half precision and within a few fp32 ulps in fp32 (the norm's sums in another
order); an out-of-range slot leaves the cache alone; bad inputs named."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.attention.dsa.indexer_rope_triton import (
    indexer_keys_ref,
    indexer_keys_triton,
    indexer_q_rope_ref,
    indexer_q_rope_triton,
)

T, D, R, H = 7, 48, 16, 5  # R < D: a pass-through part; D not a power of two


def inputs(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(T, 100, generator=gen) * 2 + 0.5).to(dtype)
    angles = torch.rand(T, R // 2, generator=gen) * 6
    tensors = {
        "k": wide[:, 20:20 + D],  # a strided view, as in_proj's output columns
        "cos": angles.cos(), "sin": angles.sin(),
        "weight": (torch.randn(D, generator=gen) * 0.5 + 1).to(dtype),
        "bias": (torch.randn(D, generator=gen) * 0.1).to(dtype),
        "q": torch.randn(T, H, 64, generator=gen).to(dtype)[..., :D],  # strided heads
    }
    return {name: x.to(device) for name, x in tensors.items()}


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_torch_ops(dtype: torch.dtype, interleaved: bool) -> None:
    x = inputs(dtype)
    slots = torch.tensor([0, 5, 6, 15, 3, 9, 1])
    want = torch.full((4, 4, D), 7.0, dtype=dtype)
    got = want.clone()
    indexer_keys_ref(x["k"], x["cos"], x["sin"], x["weight"], x["bias"], 1e-6, want, slots,
                     interleaved)
    indexer_keys_triton(x["k"], x["cos"], x["sin"], x["weight"], x["bias"], 1e-6, got, slots,
                        interleaved)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=4e-6, rtol=4e-6)
    else:
        assert torch.equal(got, want)
    q_want = indexer_q_rope_ref(x["q"], x["cos"], x["sin"], interleaved)
    q_got = indexer_q_rope_triton(x["q"], x["cos"], x["sin"], interleaved)
    assert q_got.is_contiguous() and torch.equal(q_got, q_want)


def test_a_slot_out_of_range_is_not_written() -> None:
    """-1 and num_slots write nothing (no host sync to refuse them); the rest as the
    reference writes them."""
    x = inputs(torch.float16)
    cache = torch.full((4, 4, D), 7.0, dtype=torch.float16)
    want = cache.clone()
    slots = torch.tensor([0, 5, -1, 15, 16, 9, 1])
    keep = slots.ge(0) & slots.lt(16)
    indexer_keys_ref(x["k"][keep], x["cos"][keep], x["sin"][keep], x["weight"], x["bias"],
                     1e-6, want, slots[keep], True)
    indexer_keys_triton(x["k"], x["cos"], x["sin"], x["weight"], x["bias"], 1e-6, cache, slots,
                        True)
    assert torch.equal(cache, want)


def test_empty_step() -> None:
    x = inputs(torch.float32)
    cache = torch.zeros(4, 4, D)
    empty = torch.zeros(0, D)
    indexer_keys_triton(empty, x["cos"][:0], x["sin"][:0], x["weight"], x["bias"], 1e-6, cache,
                        torch.zeros(0, dtype=torch.int64), True)
    assert not cache.any()
    assert indexer_q_rope_triton(x["q"][:0], x["cos"][:0], x["sin"][:0], True).shape == (0, H, D)


@pytest.mark.parametrize(("change", "message"), [
    ({"k": torch.zeros(T, D).t()}, "k must be floating \\[T, D\\] with a unit last stride"),
    ({"cos": torch.zeros(T, R // 2, dtype=torch.float64)}, "cos must be fp32"),
    ({"sin": torch.zeros(T, 4)}, "cos \\(7, 8\\) and sin \\(7, 4\\) differ"),
    ({"cos": torch.zeros(T, D), "sin": torch.zeros(T, D)}, "0 < R <= 48"),
    ({"weight": torch.zeros(D, dtype=torch.float16)}, "weight must be contiguous \\[48\\]"),
    ({"cache": torch.zeros(4, 4, D + 1)}, "index_cache must be contiguous"),
    ({"slots": torch.zeros(T, dtype=torch.int32)}, "slot_mapping must be int64 \\[7\\]"),
])
def test_bad_input_is_named(change: dict, message: str) -> None:
    x = inputs(torch.float32)
    args = {"k": x["k"], "cos": x["cos"], "sin": x["sin"], "weight": x["weight"],
            "bias": x["bias"], "cache": torch.zeros(4, 4, D),
            "slots": torch.zeros(T, dtype=torch.int64)} | change
    with pytest.raises(ValueError, match=message):
        indexer_keys_triton(args["k"], args["cos"], args["sin"], args["weight"], args["bias"],
                            1e-6, args["cache"], args["slots"], True)
    with pytest.raises(ValueError, match="q must be floating \\[T, H, D\\]"):
        indexer_q_rope_triton(torch.zeros(T, D), x["cos"], x["sin"], True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_gpu_bf16_matches_the_torch_ops(interleaved: bool) -> None:
    """On CUDA in bf16 (GLM-5's 128-dim keys and 64 rotary dims, 32 heads): the query bit
    exact; the key within one bf16 ulp of torch's layer_norm (its sums in CUDA's order)."""
    gen = torch.Generator().manual_seed(1)
    t, dim, rope, heads = 37, 128, 64, 32
    k = torch.randn(t, 300, generator=gen).to(torch.bfloat16).cuda()[:, 100:100 + dim]
    angles = torch.rand(t, rope // 2, generator=gen).cuda() * 6
    cos, sin = angles.cos(), angles.sin()
    w = (torch.randn(dim, generator=gen) * 0.5 + 1).to(torch.bfloat16).cuda()
    b = (torch.randn(dim, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    slots = torch.randperm(64, generator=gen)[:t].cuda()
    want = torch.zeros(16, 4, dim, dtype=torch.bfloat16, device="cuda")
    got = want.clone()
    indexer_keys_ref(k, cos, sin, w, b, 1e-6, want, slots, interleaved)
    indexer_keys_triton(k, cos, sin, w, b, 1e-6, got, slots, interleaved)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=8e-3)
    q = torch.randn(t, heads, dim, generator=gen).to(torch.bfloat16).cuda()
    assert torch.equal(indexer_q_rope_triton(q, cos, sin, interleaved),
                       indexer_q_rope_ref(q, cos, sin, interleaved))


def test_the_environment_turns_the_fused_launches_off() -> None:
    """MOESERVE_DSA_FUSED_INDEXER=0 clears layers/dsa.FUSED_ON_CUDA at import (a served A/B's
    processes); unset or anything else, on. In a fresh interpreter."""
    from moeserve import envs
    from tests.fresh_import import attribute_at_import

    for value, want in ((None, True), ("1", True), ("0", False)):
        assert attribute_at_import("moeserve.layers.dsa", "FUSED_ON_CUDA",
                                   envs.DSA_FUSED_INDEXER, value) == str(want)
