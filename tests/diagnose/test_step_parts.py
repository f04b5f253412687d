"""diagnose/bounds/step_parts.py: kernels sorted into parts, each part against its own bound."""

from __future__ import annotations

import re
from pathlib import Path

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


# every kernel moeserve defines (a function named _..._kernel under moeserve/kernels), by the
# part its device time belongs to: a kernel added or renamed must be placed here (and in
# step_parts._PATTERNS), or the step profile would count it as "other" unseen, as it did the
# warp-specialized MLA decode, DSA's bisect top-k and the MoE's align until session 58
OWN_KERNELS = {
    "_bisect_kernel": "attention", "_combine_kernel": "attention",
    "_decode_kernel": "attention", "_decode_reduce_kernel": "attention",
    "_flat_decode_kernel": "attention", "_index_score_kernel": "attention",
    "_mla_swapped_kernel": "attention", "_prefill_kernel": "attention",
    "_radix_coop_kernel": "attention", "_radix_count_kernel": "attention",
    "_radix_gather_kernel": "attention", "_radix_hist_kernel": "attention",
    "_radix_last_levels_kernel": "attention", "_radix_row_kernel": "attention",
    "_radix_write_kernel": "attention", "_slots_kernel": "attention",
    "_sparse_attention_kernel": "attention", "_ws_kernel": "attention",
    "_count_kernel": "moe", "_fused_moe_kernel": "moe", "_fused_moe_quant_kernel": "moe",
    "_moe_fp8_kernel": "moe", "_moe_fp8_ws_kernel": "moe", "_moe_ws_kernel": "moe",
    "_offsets_kernel": "moe", "_one_kernel": "moe", "_route_kernel": "moe",
    "_route_sigmoid_kernel": "moe", "_scatter_kernel": "moe", "_zero_rows_kernel": "moe",
    "_matmul_kernel": "dense", "_scale_columns_kernel": "dense", "_w4a16_kernel": "dense",
    "_keys_kernel": "norm_rope", "_mla_rope_cache_kernel": "norm_rope",
    "_q_rope_kernel": "norm_rope", "_qk_rope_kv_kernel": "norm_rope",
    "_rms_norm_kernel": "norm_rope", "_rope_kernel": "norm_rope",
    "_dequant_kernel": "other", "_quantize_kernel": "other", "_silu_mul_kernel": "other",
}


def _defined_kernels() -> set[str]:
    """The names of the kernel functions under moeserve/kernels (`def _..._kernel(`), the
    loaders `_kernel()` / `_zero_kernel()` that jit them left out (they take no arguments)."""
    root = Path(__file__).resolve().parents[2] / "moeserve" / "kernels"
    pattern = re.compile(r"^\s*def (_\w*_kernel)\((?!\))", re.MULTILINE)
    return {m.group(1) for f in root.rglob("*.py") for m in pattern.finditer(f.read_text())}


def test_every_own_kernel_is_placed_in_its_part() -> None:
    defined = _defined_kernels()
    assert len(defined) > 30  # the scan found the kernels
    assert defined == set(OWN_KERNELS), (
        f"kernels not in OWN_KERNELS: {sorted(defined - set(OWN_KERNELS))}; listed but not "
        f"defined: {sorted(set(OWN_KERNELS) - defined)}")
    wrong = {n: part_of(n) for n, part in OWN_KERNELS.items() if part_of(n) != part}
    assert not wrong, f"placed in the wrong part: {wrong}"


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
