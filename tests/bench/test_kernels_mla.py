"""benchmarks/kernels/mla/kernels_mla.py on CPU: the bounds' arithmetic, the step's scattered
blocks, W1's contexts, and the smoke run end to end through Triton's interpreter (fp32, each
case checked against mla_attention_ref)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks.kernels.mla import kernels_mla
from benchmarks.kernels.mla.kernels_mla import bounds, contexts, make_step


def test_bounds_follow_the_issues_definition() -> None:
    ctx = [4096] * 1024  # GLM-5's 64 heads at batch 1,024, 4k context
    b = bounds(ctx, 64, 512, 64, 2)
    assert b["read_bound_ms"] == pytest.approx(1024 * 4096 * 1152 / 4.27e12 * 1e3)
    assert b["flops"] == 2 * 64 * (576 + 512) * 1024 * 4096
    assert b["bound"] == "memory" and b["bound_ms"] == b["read_bound_ms"]
    v3 = bounds(ctx, 128, 512, 64, 2)  # DeepSeek-V3's 128 heads: 242 FLOPs a byte, past the
    assert v3["bound"] == "compute" and v3["bound_ms"] == v3["flop_bound_ms"]  # ridge of 184


def test_make_step_scatters_each_rows_blocks_over_the_pool() -> None:
    q, cache, meta = make_step([40, 17, 9], 4, 32, 16, 8, "cpu", torch.float32, seed=2)
    assert q.shape == (3, 4, 48) and cache.shape[1:] == (8, 48)
    assert meta.seq_lens_np.tolist() == [40, 17, 9] and meta.query_lens_np.tolist() == [1, 1, 1]
    used = [b for row, n in zip(meta.block_tables.tolist(), (5, 3, 2)) for b in row[:n]]
    assert len(set(used)) == 10 and 0 not in used and used != sorted(used)


def test_w1_contexts_span_its_lengths() -> None:
    ctx = contexts(2048, "w1")
    assert min(ctx) >= 129 and max(ctx) <= 256 and abs(sum(ctx) / len(ctx) - 192.5) < 3
    assert contexts(3, 1024) == [1024] * 3


def test_smoke_run_writes_every_case_checked(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels_mla", "--out", str(tmp_path), "--smoke"])
    kernels_mla.main()
    result = json.loads((tmp_path / "kernels_mla.json").read_text())
    assert [c["case"] for c in result["cases"]] == [name for name, *_ in kernels_mla.SMOKE_CASES]
    assert all(c["check_error"] < 1e-5 and c["ms"] > 0 for c in result["cases"])
    assert result["config"]["smoke"] and result["environment"]["torch"]


def test_smoke_run_times_each_case_at_each_tile(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels_mla", "--out", str(tmp_path), "--smoke",
                                      "--tiles", "16,16,2,1", "32,16,4,1"])
    kernels_mla.main()
    cases = json.loads((tmp_path / "kernels_mla.json").read_text())["cases"]
    assert len(cases) == 2 * len(kernels_mla.SMOKE_CASES)
    assert [c["tile"]["block_m"] for c in cases[:2]] == [16, 32]
    assert all(c["check_error"] < 1e-5 for c in cases)


def test_smoke_run_over_an_fp8_latent_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["kernels_mla", "--out", str(tmp_path), "--smoke",
                                      "--kv-cache-dtype", "fp8"])
    kernels_mla.main()
    cases = json.loads((tmp_path / "kernels_mla.json").read_text())["cases"]
    assert cases and all(c["check_error"] < 1e-5 for c in cases)  # against the same cache
    assert json.loads((tmp_path / "kernels_mla.json").read_text())["config"][
        "kv_cache_dtype"] == "fp8"
    _, cache, _ = kernels_mla.make_step([40, 9], 4, 32, 16, 8, "cpu", torch.float32,
                                        cache_dtype=torch.float8_e4m3fn)
    assert cache.dtype == torch.float8_e4m3fn  # run_case's read bound takes its 1-byte rows


@pytest.mark.parametrize(("text", "message"), [("32,32,8", "not BM,BN,W,S"),
                                               ("32,48,8,2", "block_n 48"),
                                               ("32,32,8,3,300", "maxnreg 300")])
def test_a_bad_tile_is_named(text: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        kernels_mla.parse_tile(text)


def test_a_tile_may_cap_the_registers() -> None:
    tile = kernels_mla.parse_tile("32,32,8,3,128")
    assert (tile.block_m, tile.block_n, tile.maxnreg) == (32, 32, 128)
    assert tile.launch() == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}
    assert "maxnreg" not in kernels_mla.parse_tile("32,32,8,3").launch()


def test_a_vec_form_runs_its_kernel_with_vector_stores_on_then_off(monkeypatch) -> None:
    """A "-vec" form (decode_op): the form's own call with decode_gluon.vector_stores set
    for it, and restored after (here the Triton split form, whose kernel ignores it)."""
    from moeserve.kernels.attention.mla import absorbed_triton, decode_gluon

    seen = []
    real = absorbed_triton.mla_attention_triton

    def spy(*args, **kwargs):
        seen.append((decode_gluon.vector_stores, kwargs["decode_form"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels_mla.mla_triton, "mla_attention_triton", spy)
    monkeypatch.setattr(decode_gluon, "vector_stores", False)  # as MOESERVE_MLA_VECTOR_STORES=0
    q, cache, meta = make_step([40, 17], 2, 32, 16, 8, "cpu", torch.float32, seed=1)
    cfg = absorbed_triton.default_config("decode", 32, torch.float32, 2)
    out = kernels_mla.decode_op(q, cache, meta, 32, cfg, "split-vec")()
    assert seen == [(True, "split")] and not decode_gluon.vector_stores
    assert out.shape == (2, 2, 32)


def test_the_auto_form_times_the_launchers_own_pick(tmp_path, monkeypatch) -> None:
    """"auto" with no --tiles hands mla_attention_triton no tile (a tile would force its Triton
    kernel on sm90, not the Gluon kernels a served step runs); with --tiles, that tile."""
    from moeserve.kernels.attention.mla import absorbed_triton

    seen = []
    real = absorbed_triton.mla_attention_triton

    def spy(*args, **kwargs):
        seen.append(kwargs.get("decode_config"))
        return real(*args, **kwargs)
    monkeypatch.setattr(absorbed_triton, "mla_attention_triton", spy)
    monkeypatch.setattr(sys, "argv", ["kernels_mla", "--out", str(tmp_path), "--smoke",
                                      "--l2-flush", "read"])
    kernels_mla.main()
    result = json.loads((tmp_path / "kernels_mla.json").read_text())
    assert seen and all(cfg is None for cfg in seen)
    assert result["config"]["l2_flush"] == "read"
    assert all(c["kernel"] in absorbed_triton.DECODE_FORMS for c in result["cases"])  # CPU
    seen.clear()
    monkeypatch.setattr(sys, "argv", ["kernels_mla", "--out", str(tmp_path), "--smoke",
                                      "--tiles", "16,16,2,1"])
    kernels_mla.main()
    assert seen and all(cfg == kernels_mla.parse_tile("16,16,2,1") for cfg in seen)
