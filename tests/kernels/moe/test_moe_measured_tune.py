"""The engine tune behind the "measured" MoE backend: backend picks recorded by the tuner, the
JSON round trip, the time budget and resume, the quick grid, `ensure_tuned` at start-up (a
committed file kept as it is, a partial tune resumed), with fake timers standing in for the
CUDA ones (test_moe_measured.py: the lookup and the backend).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve.kernels.moe import search as moe_search
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe import tune as moe_tune
from moeserve.kernels.moe.search import candidate_key, quick_moe_candidates, trial_key
from moeserve.kernels.moe.tile_configs import (
    config_file_name,
    engine_token_counts,
    find_tuned,
    get_moe_config,
)
from moeserve.kernels.moe.tune import ensure_tuned, tune_for_engine, tune_moe
from tests.kernels.moe.test_moe_measured import (
    SMALL,
    SPLIT,
    E,
    H,
    K,
    N,
    write_tuned,
)

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py


def part_ms(part: str, config: dict, num_tokens: int) -> float:
    """Fake part times: align 0.01 ms; a launch 0.05 ms + tokens / 2000 + 1/160 ms per 1 of
    BLOCK_N away from its best, 16 for the gated launch, 32 for the down one."""
    if part == "align":
        return 0.01
    best = 16 if part == "gated" else 32
    return 0.05 + abs(config["BLOCK_N"] - best) / 160 + num_tokens / 2000


def fake_timers(grouped_ms: dict[int, float]) -> tuple[list, object, object]:
    """A Triton timer by parts (`part_ms`; the whole op: its parts + 0.001 ms) and a grouped_mm
    one; calls are logged as (ledger key, num_tokens)."""
    calls: list[tuple[str, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((trial_key(part, config), num_tokens))
        if part == "moe":
            return (part_ms("align", config, num_tokens) + part_ms("gated", config, num_tokens)
                    + part_ms("down", moe_configs.down_tiles(config), num_tokens) + 0.001)
        return part_ms(part, config, num_tokens)

    def baseline(num_tokens: int) -> float:
        calls.append(("grouped_mm", num_tokens))
        if num_tokens not in grouped_ms:
            raise RuntimeError("grouped_mm unsupported here")
        return grouped_ms[num_tokens]

    return calls, timer, baseline


GRID = [dict(SMALL, BLOCK_N=n) for n in (16, 32, 64)]
TIMINGS = 1 + 2 * len(GRID) + 1  # per token count: the align, each tile per launch, the whole


def test_tune_records_both_timings_and_the_pick_and_round_trips(tmp_path: Path) -> None:
    calls, timer, baseline = fake_timers({1: 0.05, 8: 0.5})  # 64: grouped_mm fails
    path = tmp_path / "env" / config_file_name(E, H, N, torch.float32, "cpu")
    best = tune_moe(E, H, N, K, torch.float32, [1, 8, 64], path, candidates=lambda n: GRID,
                    timer=timer, baseline_timer=baseline, device_name="cpu",
                    log=lambda s: None)
    assert {n: e["backend"] for n, e in best.items()} == {1: "grouped_mm", 8: "triton",
                                                           64: "triton"}
    # "ms" is the whole op's time with the split pick: 0.01 + 2 * (0.05 + T / 2000) + 0.001
    assert best[1]["grouped_mm_ms"] == 0.05 and best[1]["ms"] == pytest.approx(0.112)
    assert "grouped_mm_ms" not in best[64]
    assert len(calls) == 3 * (TIMINGS + 1)  # + grouped_mm
    doc = json.loads(path.read_text())
    assert doc["grouped_mm"]["64"].startswith("error: RuntimeError")
    assert doc["configs"]["8"] == {**SPLIT, "ms": pytest.approx(0.119),
                                   "grouped_mm_ms": 0.5, "backend": "triton"}
    assert doc["trials"]["8"][trial_key("moe", SPLIT)] == pytest.approx(0.119)
    assert get_moe_config(E, H, N, K, torch.float32, 8, "cpu").config == SPLIT
    found_path, table = find_tuned(E, H, N, torch.float32, "cpu")
    assert found_path == str(path) and table == best  # what the lookup reads is what was tuned
    # a rerun times nothing again, grouped_mm included
    calls.clear()
    assert tune_moe(E, H, N, K, torch.float32, [1, 8, 64], path, candidates=lambda n: GRID,
                    timer=timer, baseline_timer=baseline, device_name="cpu",
                    log=lambda s: None) == best
    assert calls == []


def test_tune_stops_at_the_time_budget_and_resumes(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(moe_tune, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    calls, timer, baseline = fake_timers({1: 9.0, 2: 9.0, 4: 9.0})

    def slow_timer(part: str, config: dict, num_tokens: int) -> float:
        clock.now += 1.0  # each timing costs one second
        return timer(part, config, num_tokens)

    logs: list[str] = []
    path = tmp_path / "t.json"
    kwargs = dict(candidates=lambda n: GRID, timer=slow_timer, baseline_timer=baseline,
                  device_name="cpu", log=logs.append)
    done = tune_moe(E, H, N, K, torch.float32, [1, 2, 4], path, time_budget_s=9.2, **kwargs)
    assert sorted(done) == [1]  # 10 timings ran (t = 0..9): T=1's 8, T=2's align and 1 gated
    assert any("time budget of 9 s spent at T=2" in line for line in logs)
    assert any("T=1: 7 timings to run over BLOCK_M [16], estimated" in line for line in logs)
    assert list(json.loads(path.read_text())["trials"]["2"]) == [
        trial_key("align", SMALL), trial_key("gated", GRID[0])]
    calls.clear()
    done = tune_moe(E, H, N, K, torch.float32, [1, 2, 4], path, time_budget_s=100, **kwargs)
    assert sorted(done) == [1, 2, 4] and done[4] == {**SPLIT, "ms": pytest.approx(0.115),
                                                     "backend": "triton", "grouped_mm_ms": 9.0}
    plan = ([trial_key("gated", c) for c in GRID] + [trial_key("down", c) for c in GRID]
            + [trial_key("moe", SPLIT)])
    assert calls == [(k, 2) for k in plan[1:]] + [("grouped_mm", 2)] + \
        [(k, 4) for k in [trial_key("align", SMALL)] + plan] + [("grouped_mm", 4)]


def test_engine_token_counts() -> None:
    assert engine_token_counts() == [1 << i for i in range(14)]  # 1 .. 8192
    assert engine_token_counts(2048)[-3:] == [512, 1024, 2048]
    assert engine_token_counts(6000)[-2:] == [4096, 6000]
    assert engine_token_counts(1 << 20)[-1] == 8192 and engine_token_counts(1) == [1]


@pytest.mark.parametrize(("num_experts", "top_k"), [(128, 8), (8, 2), (64, 6)])
def test_quick_grid_is_small_fits_and_compiles_few_configs(num_experts: int,
                                                           top_k: int) -> None:
    counts = engine_token_counts()
    grids = [quick_moe_candidates(num_experts, top_k, n) for n in counts]
    distinct = {candidate_key(c) for grid in grids for c in grid}
    assert all(6 <= len(grid) <= 18 for grid in grids) and len(distinct) <= 30
    for num_tokens, grid in zip(counts, grids):
        assert len({candidate_key(c) for c in grid}) == len(grid)
        per_expert = num_tokens * top_k / num_experts
        for c in grid:
            assert c["BLOCK_M"] <= max(16, 2 * per_expert)
            smem = (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * 2 * c["num_stages"]
            assert smem <= 227 * 1024, c  # the gated launch's bf16 tiles fit an H100/H200
    assert {c["BLOCK_M"] for c in grids[0]} == {16}  # decode: one block per expert
    assert {c["BLOCK_M"] for c in grids[-1]} == {64, 128}
    if (num_experts, top_k) == (128, 8):  # 1024 tokens: 64 per expert, BLOCK_M down to 32
        assert {c["BLOCK_M"] for c in grids[counts.index(1024)]} == {32, 64, 128}
    # the whole qwen3-30b-a3b tune's prior estimate stays well within ensure_tuned's budget
    assert moe_tune.estimate_tune_seconds(grids) < moe_tune.DEFAULT_TUNE_BUDGET_S / 2


# ---------------------------------------------------------------- ensure_tuned

def test_ensure_tuned_tunes_once_then_returns_at_once(isolated_config_dirs: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(moe_configs.CONFIG_DIR_ENV)  # tunes go to the user cache
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(moe_tune, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    calls, fast_timer, fast_baseline = fake_timers({1: 0.01})

    def timer(part: str, config: dict, num_tokens: int) -> float:
        clock.now += 0.5  # each timing costs half a second of the tune's clock
        return fast_timer(part, config, num_tokens)

    def baseline(num_tokens: int) -> float:
        clock.now += 0.5
        return fast_baseline(num_tokens)

    args = (E, H, N, K, torch.float16, 4)  # engine counts 1, 2, 4
    outcome = ensure_tuned(*args, timer=timer, baseline_timer=baseline,
                           device_name="Fake GPU", log=lambda s: None)
    expected = (isolated_config_dirs / "cache" / "moe_configs"
                / config_file_name(E, H, N, torch.float16, "Fake GPU"))
    assert outcome.tuned and outcome.source == str(expected) and expected.exists()
    assert outcome.detail.startswith("tuned now: 3 of 3 token counts")
    assert {n for _, n in calls} == {1, 2, 4}
    # per token count: an align per BLOCK_M, each tile per launch, the whole op, grouped_mm
    grids = {n: moe_search.tiles_by_block_m(quick_moe_candidates(E, K, n)) for n in (1, 2, 4)}
    assert len(calls) == sum(len(g) + 2 * sum(map(len, g.values())) + 2 for g in grids.values())
    assert outcome.seconds == 0.5 * len(calls)  # the tune's time: its timings
    choice = get_moe_config(E, H, N, K, torch.float16, 1, "Fake GPU")
    assert choice.tuned and choice.backend == "grouped_mm"
    calls.clear()
    again = ensure_tuned(*args, timer=timer, baseline_timer=baseline, device_name="Fake GPU",
                         log=lambda s: None)
    assert calls == [] and again.tuned and again.detail == "tuned earlier (cached)"
    assert again.source == outcome.source and again.seconds == 0.0  # nothing timed: no time


def test_ensure_tuned_uses_a_committed_file_as_it_is(isolated_config_dirs: Path) -> None:
    path = write_tuned(isolated_config_dirs / "package", {64: SMALL}, device="Fake GPU",
                       dtype=torch.float16)

    def timer(part: str, config: dict, num_tokens: int) -> float:
        raise AssertionError("a committed file is not re-tuned")

    outcome = ensure_tuned(E, H, N, K, torch.float16, 8192, timer=timer, device_name="Fake GPU",
                           log=lambda s: None)
    assert outcome.tuned and outcome.source == str(path) and outcome.detail == "committed"


def test_ensure_tuned_resumes_a_partial_tune(isolated_config_dirs: Path) -> None:
    path = (isolated_config_dirs / "env"
            / config_file_name(E, H, N, torch.float16, "Fake GPU"))
    calls, timer, _ = fake_timers({})
    kwargs = dict(timer=timer, device_name="Fake GPU", log=lambda s: None)
    tune_for_engine(E, H, N, K, torch.float16, path, token_counts=[1], **kwargs)
    calls.clear()
    outcome = ensure_tuned(E, H, N, K, torch.float16, 2, **kwargs)  # wants 1 and 2
    assert {n for _, n in calls} == {2} and outcome.detail.startswith("tuned now: 2 of 2")
    assert outcome.source == str(path)
    calls.clear()
    spent = ensure_tuned(E, H, N, K, torch.float16, 8, time_budget_s=0, **kwargs)
    assert calls == [] and "time budget spent" in spent.detail and spent.tuned


def test_ensure_tuned_without_cuda_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    outcome = ensure_tuned(E, H, N, K, torch.float16, 8192)
    assert outcome == (0.0, False, "default", outcome.detail) and "no CUDA" in outcome.detail
