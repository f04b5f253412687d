"""diagnose/bounds/step_parts.py: kernels sorted into parts, each part against its own bound."""

from __future__ import annotations

import pytest

from moeserve.config import load_model_config
from moeserve.diagnose.bounds.roofline import CEILINGS, step_cost
from moeserve.diagnose.bounds.step_parts import PARTS, describe, part_of, part_shares, part_times_ms

H200 = CEILINGS[0]

# names as torch.profiler reported them on the H200 (benchmarks/results/profile_step_*.json)
KERNELS = {
    "_fused_moe_kernel": "moe",
    "_moe_align_kernel": "moe",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::": "moe",
    "void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>": "moe",
    "_decode_kernel": "attention",
    "_mla_swapped_kernel": "attention",  # mla/decode_gluon_swapped.py
    "_prefill_kernel": "attention",
    "_decode_reduce_kernel": "attention",
    # DSA's indexer: its reads and FLOPs are in the attention part's bound (roofline.step_cost)
    "_index_score_kernel": "attention",
    "_radix_hist_kernel": "attention",
    "_radix_count_kernel": "attention",
    "_radix_write_kernel": "attention",
    "_sparse_attention_kernel": "attention",
    "_slots_kernel": "attention",
    "nvjet_sm90_tst_128x192_64x5_2x1_v_bz_coopB_TNN": "dense",
    "aten::mm": "dense",
    "_rms_norm_kernel": "norm_rope",
    "_qk_rope_kv_kernel": "norm_rope",
    "_rope_kernel": "norm_rope",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda": "other",
    "Memcpy HtoD (Pinned -> Device)": "other",
}


@pytest.mark.parametrize(("name", "part"), list(KERNELS.items()))
def test_kernels_fall_into_their_parts(name: str, part: str) -> None:
    assert part_of(name) == part


def test_times_add_up_per_part() -> None:
    ms = part_times_ms([("_fused_moe_kernel", 18.0), ("_moe_align_kernel", 1.2),
                        ("_decode_kernel", 4.7), ("nvjet_x", 3.0), ("weird", 0.5)])
    assert list(ms) == list(PARTS)
    assert ms == pytest.approx({"moe": 19.2, "attention": 4.7, "dense": 3.0, "norm_rope": 0.0,
                                "other": 0.5})


def _decode_cost(batch: int = 1024, context: float = 192.0):
    model = load_model_config("qwen3-30b-a3b")[0]
    return step_cost(model, 2, tokens=batch, rows=batch, batch=batch, context=context)


def test_parts_split_the_step_cost() -> None:
    cost = _decode_cost()
    parts = cost.parts()
    assert set(parts) == {"moe", "attention", "dense"}
    assert sum(b for b, _ in parts.values()) == pytest.approx(cost.bytes)
    assert sum(f for _, f in parts.values()) == pytest.approx(cost.flops)
    assert parts["moe"][0] == cost.expert_bytes and parts["attention"][0] == cost.kv_bytes
    # the parts' bounds add up to at least the step's
    total = sum(s.bound_ms for s in part_shares(cost, H200, {}) if s.bound_ms is not None)
    assert total >= 1e3 * cost.bound_seconds(H200) * (1 - 1e-9)


def test_attention_part_counts_its_queries_and_outputs() -> None:
    """A mixed step's absorbed MLA: the prefill tokens' queries and outputs bound the attention
    part (and stay out of the step's roofline bytes)."""
    model = load_model_config("glm-4.7-flash")[0]
    m = model.mla
    cost = step_cost(model, 2, tokens=1024 + 8192, rows=1024 + 64, batch=1024 + 64,
                     context=192.0)
    io = (1024 + 8192) * model.num_layers * model.num_heads * (m.latent_dim + m.kv_lora_rank) * 2
    assert cost.attention_io_bytes == io
    assert cost.bytes == cost.expert_bytes + cost.dense_bytes + cost.kv_bytes
    share = next(s for s in part_shares(cost, H200, {"attention": 10.0}) if s.part == "attention")
    want = max((cost.kv_bytes + io) / H200.bytes_per_s, cost.attention_flops / H200.flops_per_s)
    assert share.bound_ms == pytest.approx(1e3 * want)
    assert io > cost.kv_bytes and share.bound_kind == "memory"


def test_each_part_against_its_own_bound() -> None:
    cost = _decode_cost()
    shares = {s.part: s for s in part_shares(cost, H200, {"moe": 18.0, "attention": 4.7,
                                                          "dense": 3.0, "norm_rope": 0.8})}
    moe = shares["moe"]
    assert moe.bound_kind == "memory"  # a decode step reads every expert at 1,024 tokens
    assert moe.bound_ms == pytest.approx(1e3 * cost.expert_bytes / H200.bytes_per_s, rel=1e-6)
    assert moe.share == pytest.approx(moe.bound_ms / 18.0)
    assert shares["norm_rope"].bound_ms is None and shares["norm_rope"].share is None
    assert shares["other"].measured_ms == 0.0
    line = describe(list(shares.values()))
    assert line.startswith("moe 18.00 ms (") and "of its memory bound" in line
    assert "norm_rope 0.80 ms" in line and "other" not in line
    assert shares["attention"].to_dict()["percent_of_bound"] == pytest.approx(
        100 * shares["attention"].bound_ms / 4.7, abs=0.05)


def test_a_long_prefill_is_compute_bound_in_its_dense_and_attention_parts() -> None:
    model = load_model_config("qwen3-30b-a3b")[0]
    cost = step_cost(model, 2, tokens=8192, rows=1, batch=1, context=8192)
    shares = {s.part: s for s in part_shares(cost, H200, {"dense": 10.0, "attention": 10.0})}
    assert shares["dense"].bound_kind == "compute"
    assert shares["moe"].bound_kind == "compute"


def test_folded_shared_experts_count_in_the_moe_part() -> None:
    """With fold_shared_experts the shared experts run in the MoE launch: their weights (always
    read) and FLOPs move from the dense part's bound to the MoE part's; the step's totals stay."""
    model = load_model_config("glm-4.7-flash")[0]
    layers = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    shared = layers * 3 * model.hidden_size * model.shared_expert_intermediate_size
    assert shared > 0
    apart, folded = (step_cost(model, 2, 8192, 1190, 1190, 157.0, shared_in_moe=f)
                     for f in (False, True))
    assert folded.bytes == pytest.approx(apart.bytes)
    assert folded.flops == pytest.approx(apart.flops)
    assert folded.expert_bytes - apart.expert_bytes == pytest.approx(2 * shared)
    assert apart.dense_bytes - folded.dense_bytes == pytest.approx(2 * shared)
    assert folded.expert_flops - apart.expert_flops == pytest.approx(2 * 8192 * shared)
    assert apart.dense_flops - folded.dense_flops == pytest.approx(2 * 8192 * shared)
    moe = {s.part: s for s in part_shares(folded, H200, {"moe": 50.0, "dense": 30.0})}
    moe_apart = {s.part: s for s in part_shares(apart, H200, {"moe": 50.0, "dense": 30.0})}
    assert moe["moe"].bound_ms > moe_apart["moe"].bound_ms
    assert moe["dense"].bound_ms < moe_apart["dense"].bound_ms
