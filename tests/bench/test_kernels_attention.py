"""benchmarks/kernels/kernels_attention.py's prefill tile sweep, on CPU: case construction, FLOP
count, the skip rules, the sweep loop with a fake trial and clock, and one small sweep end to end
through Triton's interpreter (fp32: the interpreter cannot take bf16) with a fake timer."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.kernels.kernels_attention import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PREFILL_CASES,
    PREFILL_GRID,
    bandwidth,
    causal_flops,
    prefill_skip_reason,
    prefill_step,
    summary_line,
    sweep_prefill,
    sweep_prefill_configs,
)
from moeserve.kernels.attention.paged_triton import TileConfig, default_config


def cpu_pool(num_blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)


def test_prefill_step_scatters_each_rows_blocks() -> None:
    pool = cpu_pool(64)
    q, meta = prefill_step(pool, [20, 0], [13, 40], seed=3)
    assert q.shape == (53, HEADS, HEAD_DIM) and q.dtype == pool.dtype
    assert meta.seq_lens_np.tolist() == [33, 40] and meta.query_lens_np.tolist() == [13, 40]
    used = [b for row, n in zip(meta.block_tables.tolist(), (3, 3)) for b in row[:n]]
    assert len(set(used)) == 6 and 0 not in used  # distinct blocks, never the null block
    again, _ = prefill_step(pool, [20, 0], [13, 40], seed=3)
    assert torch.equal(q, again)
    with pytest.raises(ValueError, match="too small"):
        prefill_step(pool, [0], [64 * BLOCK])


def test_causal_flops() -> None:
    # W1's mixed step: 64 fresh prompts of 128 tokens, ~8.66 GFLOP per layer
    assert causal_flops([0] * 64, [128] * 64) == 4 * HEADS * HEAD_DIM * 64 * (128 * 129 // 2)
    assert abs(causal_flops(*PREFILL_CASES[0][1:]) / 1e9 - 8.657) < 1e-3
    # after a prefix of 2, three queries see 3, 4 and 5 keys
    assert causal_flops([2], [3]) == 4 * HEADS * HEAD_DIM * 12
    assert [name for name, *_ in PREFILL_CASES] == ["w1_64x128_fresh", "8x1024_fresh",
                                                    "8x512_after_512"]


def test_skip_rules_keep_the_default_and_drop_obvious_overflows() -> None:
    default = default_config("prefill", HEAD_DIM, torch.bfloat16)
    assert default in PREFILL_GRID and prefill_skip_reason(default) is None
    assert "shared memory" in prefill_skip_reason(TileConfig(256, 128, 8, 3))
    assert "registers" in prefill_skip_reason(TileConfig(256, 64, 4, 2))
    kept = [c for c in PREFILL_GRID if prefill_skip_reason(c) is None]
    assert len(PREFILL_GRID) == 54 and 30 <= len(kept) < 54


def test_sweep_loop_records_errors_skips_and_the_best() -> None:
    default = TileConfig(128, 64, 8, 2)
    configs = [TileConfig(64, 32, 4, 1), TileConfig(256, 128, 8, 3),  # skipped: shared memory
               TileConfig(64, 64, 4, 2), default, TileConfig(128, 128, 8, 1)]
    speed = {default: 0.1, TileConfig(64, 32, 4, 1): 0.05, TileConfig(128, 128, 8, 1): 0.01}

    def trial(i: int, cfg: TileConfig) -> dict:
        if cfg == TileConfig(64, 64, 4, 2):
            raise RuntimeError("out of resources")
        if i == 1 and cfg == TileConfig(64, 32, 4, 1):
            raise AssertionError("Tensor-likes are not close!")
        return {"ms": speed[cfg] * (i + 1), "max_abs_err": 0.01}

    ticks = itertools.count()  # 1 s per clock read (start, then each config not skipped)
    cases = [{"case": "a", "flops": 10 ** 9}, {"case": "b", "flops": 2 * 10 ** 9}]
    lines: list[str] = []
    sweep_prefill_configs(cases, trial, configs, default, deadline_s=2.2,
                          clock=lambda: float(next(ticks)), log=lines.append)
    a, b = cases
    assert [t["block_m"] for t in a["trials"]] == [128, 64, 256, 64, 128]  # default first, once
    assert a["default"] == a["trials"][0] and a["default"]["ms"] == 0.1
    assert a["default"]["tflops"] == 10.0 and a["default"]["pct_of_dense"] == 1.3
    assert a["default"]["ms_48_layers"] == 4.8
    assert "shared memory" in a["trials"][2]["skipped"]
    assert a["trials"][3]["error"] == "RuntimeError: out of resources"
    assert a["trials"][4]["skipped"] == "deadline 2 s"
    assert b["trials"][1]["error"].startswith("AssertionError")
    assert a["best"]["block_m"] == 64 and a["best"]["ms"] == 0.05
    assert b["best"] == b["default"]  # its faster config failed the accuracy check
    assert len(lines) == 6  # one per trial that ran or failed, none for skips
    line = summary_line(a)
    assert "default 0.1000 ms, best 0.0500 ms" in line and "block_m=64" in line


def test_summary_when_nothing_ran() -> None:
    default = TileConfig(128, 64, 8, 2)
    cases = [{"case": "a", "flops": 1}]

    def fail(i: int, cfg: TileConfig) -> dict:
        raise RuntimeError("no GPU")

    sweep_prefill_configs(cases, fail, [default], default, 10.0, log=lambda _: None)
    assert cases[0]["best"] is None and "no GPU" in summary_line(cases[0])


def test_sweep_end_to_end_in_the_interpreter() -> None:
    pool = cpu_pool(48)  # fp32
    default = default_config("prefill", HEAD_DIM, torch.float32)
    cases = [("fresh", [0, 0], [9, 21]), ("chunk", [19], [12])]
    configs = [TileConfig(16, 16, 4, 1), TileConfig(32, 32, 4, 2)]
    rows = sweep_prefill(pool, 1e9, cases, configs, timer=lambda fn: 1.0,
                         eager_timer=lambda fn: 2.0)
    assert [r["case"] for r in rows] == ["fresh", "chunk"]
    for row in rows:
        assert [t["block_m"] for t in row["trials"]] == [default.block_m, 16, 32]
        assert all("ms" in t and t["max_abs_err"] < 1e-4 for t in row["trials"]), row
        assert row["default_eager_ms"] == 2.0
    assert rows[1]["flops"] == causal_flops([19], [12])


def test_long_prefill_cases_are_8k_prompts() -> None:
    """The long set is issue 14's: one fresh 8,192-token prompt and four last 2,048-token
    chunks of 8k prompts, at the causal FLOPs of their visible keys."""
    from benchmarks.kernels.kernels_attention import LONG_PREFILL_CASES, PREFILL_CASE_SETS

    assert PREFILL_CASE_SETS["long"] is LONG_PREFILL_CASES
    assert [sum(c) + sum(n) for _, c, n in LONG_PREFILL_CASES] == [8192, 4 * 8192]
    fresh, chunks = (causal_flops(c, n) for _, c, n in LONG_PREFILL_CASES)
    assert chunks > fresh  # the last quarter of four prompts sees more keys than one whole


def test_an_fp8_pool_takes_bf16_queries_and_counts_its_bytes() -> None:
    pool = cpu_pool(64).to(torch.float8_e4m3fn)
    q, _ = prefill_step(pool, [0], [5])
    assert q.dtype == torch.bfloat16
    assert bandwidth(64, 1000, 0.01, elem_bytes=1)["kv_gb_per_s"] * 2 == \
        bandwidth(64, 1000, 0.01)["kv_gb_per_s"]
