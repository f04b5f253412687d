"""benchmarks/kernels/mla/kernels_mla_prefill.py on CPU: the FLOP model of the two prefill forms,
the step's layout, and one case end to end through Triton's interpreter (fp32, both forms
compared, a fake timer deciding which is faster)."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.kernels.mla.kernels_mla_prefill import (
    SMOKE_CASES,
    layer_for,
    make_step,
    prefill_flops,
    run_case,
)


@pytest.fixture(scope="module")
def glm_layer() -> object:
    return layer_for("glm-4.7-flash", "cpu", torch.float32, smoke=True)


def test_flops_follow_the_module_doc() -> None:
    layer = layer_for("glm-4.7-flash", "meta", torch.bfloat16)  # the real shape, no memory
    assert (layer.num_heads, layer.kv_lora_rank, layer.rope_dim) == (20, 512, 64)
    f = prefill_flops(layer, prompts=2, query=128, prefix=0)
    pairs = 128 * 129 // 2
    proj = 2 * 512 * (192 + 256)
    assert f["mha"] == 2 * 20 * (pairs * 2 * (192 + 64 + 256) + 128 * proj)
    assert f["absorbed"] == 2 * 20 * (pairs * 2 * (2 * 512 + 64) + 128 * proj)
    # a fresh prompt: the up-projected form has fewer FLOPs at any length
    for n in (16, 512, 8192):
        f = prefill_flops(layer, 1, n, 0)
        assert f["mha"] < f["absorbed"]
    # a short chunk after a long prefix: the absorbed form has fewer
    f = prefill_flops(layer, 1, 64, 8192)
    assert f["absorbed"] < f["mha"]


def test_step_puts_the_decodes_first_and_fills_the_cache(glm_layer) -> None:
    q_nope, q_rope, meta = make_step(glm_layer, ("c", 2, 5, 9, 3), 4, "cpu", torch.float32)
    assert meta.query_lens_np.tolist() == [1, 1, 1, 5, 5]
    assert meta.seq_lens_np[3:].tolist() == [14, 14]
    assert all(129 <= n <= 256 for n in meta.seq_lens_np[:3])
    assert q_nope.shape == (13, 2, glm_layer.nope) and q_rope.shape == (13, 2, 16)
    blocks = glm_layer.kv_cache.shape[0]
    used = {b for row in meta.block_tables.tolist() for b in row if b}
    assert len(used) == blocks - 1  # every block but the null block, once


def test_a_case_compares_the_forms_and_names_the_faster(glm_layer) -> None:
    times = itertools.cycle([3.0, 1.5])  # mha, then absorbed

    def timer(fn) -> float:
        fn()
        return next(times)

    row = run_case("glm-4.7-flash", glm_layer, SMOKE_CASES[0], 4, "cpu", torch.float32,
                   timer)
    assert row["check_error"] < 1e-4
    assert (row["mha_ms"], row["absorbed_ms"]) == (3.0, 1.5)
    assert row["faster"] == "absorbed" and row["absorbed_speedup"] == 2.0


def test_smoke_run_writes_every_preset_and_case_checked(tmp_path, monkeypatch) -> None:
    """The whole --smoke run (every preset narrowed to SMOKE_DIMS: a preset's own head
    fields, qk_head_dim and head_dim among them, must not contradict the narrowed ones), with
    --chunk-bytes set (the context's chunks then MIN_CHUNK tokens) and the fresh prompts'
    varlen form timed too (checked against mha like the others)."""
    import json
    import sys

    from benchmarks.kernels.mla import kernels_mla_prefill
    from moeserve.kernels.attention.mla import up_projected

    monkeypatch.setattr(up_projected, "CHUNK_BYTES", up_projected.CHUNK_BYTES)  # restored
    monkeypatch.setattr(sys, "argv", ["kernels_mla_prefill", "--out", str(tmp_path), "--smoke",
                                      "--chunk-bytes", "1", "--fresh-varlen"])
    kernels_mla_prefill.main()
    result = json.loads((tmp_path / "kernels_mla_prefill.json").read_text())
    assert [(c["preset"], c["case"]) for c in result["cases"]] == [
        (p, name) for p in kernels_mla_prefill.PRESETS for name, *_ in SMOKE_CASES]
    assert all(c["check_error"] < 1e-4 and c["fresh_varlen_ms"] > 0 for c in result["cases"])
    assert result["config"]["chunk_bytes"] == 1 and up_projected.CHUNK_BYTES == 1
