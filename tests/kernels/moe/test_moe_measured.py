"""The "measured" MoE backend and the engine tune: backend picks recorded by the tuner, nearest
token count lookup, the JSON round trip, the time budget and resume, `ensure_tuned`.

On CPU the Triton kernel runs through the interpreter (tests/conftest.py) on tiny shapes; tuned
files are written for the device name "cpu" (what the backend looks up for CPU tensors) or
"Fake GPU", with fake timers standing in for the CUDA ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve.kernels.moe import measured as moe_measured
from moeserve.kernels.moe import search as moe_search
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe import tune as moe_tune
from moeserve.kernels.moe.ref import moe_loop_ref
from moeserve.kernels.moe.search import candidate_key, quick_moe_candidates, trial_key
from moeserve.kernels.moe.tile_configs import (
    config_file_name,
    engine_token_counts,
    find_tuned,
    get_moe_config,
    nearest_token_count,
)
from moeserve.kernels.moe.tune import ensure_tuned, tune_for_engine, tune_moe
from moeserve.kernels.routing.select import select_experts

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, N, K = 8, 32, 16, 2  # tiny expert shape: experts, hidden, expert width, top-k
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)




def write_tuned(directory: Path, entries: dict[int, dict], device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / config_file_name(E, H, N, dtype, device)
    doc = {"meta": {}, "configs": {str(n): e for n, e in entries.items()}}
    path.write_text(json.dumps(doc))
    moe_configs.clear_caches()
    return path


def experts_and_tokens(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, N, generator=gen) * N ** -0.5
    x = torch.randn(num_tokens, H, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=gen), K, renormalize=True)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, ids))


class Spy:
    """Counts the calls of each backend inside moe_measured, and runs the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, dict | None]] = []
        real_triton, real_grouped = moe_measured.moe_triton, moe_measured.moe_grouped_mm

        def triton(x: torch.Tensor, *args: torch.Tensor, config: dict,
                   reduce: bool = True) -> torch.Tensor:
            self.calls.append(("triton", x.shape[0], config))
            return real_triton(x, *args, config=config, reduce=reduce)

        def grouped(x: torch.Tensor, *args: torch.Tensor, reduce: bool = True) -> torch.Tensor:
            self.calls.append(("grouped_mm", x.shape[0], None))
            return real_grouped(x, *args, reduce=reduce)

        monkeypatch.setattr(moe_measured, "moe_triton", triton)
        monkeypatch.setattr(moe_measured, "moe_grouped_mm", grouped)


# ---------------------------------------------------------------- lookup

def test_nearest_token_count_takes_the_closest_and_the_smaller_on_ties() -> None:
    tuned = [1, 4, 16, 64]
    assert [nearest_token_count(tuned, n) for n in (0, 1, 2, 3, 10, 11, 40, 41, 5000)] == \
        [1, 1, 1, 4, 4, 16, 16, 64, 64]  # 10: 6 from 4 and from 16
    assert nearest_token_count({8: "a", 2: "b"}, 5) == 2  # tie 2 / 8: the smaller


def test_entry_backend_is_read_and_defaults_to_triton(isolated_config_dirs: Path) -> None:
    path = write_tuned(isolated_config_dirs / "env", {
        1: {**SMALL, "ms": 0.3, "grouped_mm_ms": 0.2, "backend": "grouped_mm"},
        64: {**SMALL, "BLOCK_M": 32, "ms": 0.5}})  # an older file: no backend recorded
    small = get_moe_config(E, H, N, K, torch.float32, 3, "cpu")
    assert (small.backend, small.tuned_tokens, small.source) == ("grouped_mm", 1, str(path))
    large = get_moe_config(E, H, N, K, torch.float32, 100, "cpu")
    assert (large.backend, large.tuned_tokens, large.config["BLOCK_M"]) == ("triton", 64, 32)
    untuned = get_moe_config(E, H, N, K, torch.float16, 3, "cpu")
    assert (untuned.tuned, untuned.backend, untuned.tuned_tokens) == (False, "triton", None)
    write_tuned(isolated_config_dirs / "env", {1: {**SMALL, "backend": "cutlass"}})
    with pytest.raises(ValueError, match="backend 'cutlass'"):
        get_moe_config(E, H, N, K, torch.float32, 3, "cpu")


def test_lookup_order_env_then_package_then_user_cache(isolated_config_dirs: Path) -> None:
    cache = isolated_config_dirs / "cache" / "moe_configs"
    write_tuned(cache, {8: dict(SMALL, BLOCK_N=64)})
    assert find_tuned(E, H, N, torch.float32, "cpu")[0] == str(cache / config_file_name(
        E, H, N, torch.float32, "cpu"))
    write_tuned(isolated_config_dirs / "package", {8: dict(SMALL, BLOCK_N=32)})
    assert get_moe_config(E, H, N, K, torch.float32, 8, "cpu").config["BLOCK_N"] == 32
    write_tuned(isolated_config_dirs / "env", {8: dict(SMALL, BLOCK_N=16)})
    assert get_moe_config(E, H, N, K, torch.float32, 8, "cpu").config["BLOCK_N"] == 16


def test_the_capacity_report_names_the_down_tiles(isolated_config_dirs: Path) -> None:
    from moeserve.engine import moe_setup

    write_tuned(isolated_config_dirs / "env", {1: SMALL, 64: {**SPLIT, "backend": "grouped_mm"}},
                device="Fake GPU", dtype=torch.float16)
    cfg = SimpleNamespace(moe_backend="measured", moe_tiles="tuned",
                          scheduler=SimpleNamespace(max_num_batched_tokens=2048))
    mc = SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=N,
                         num_experts_per_tok=K)
    report = moe_setup.moe_configs(cfg, mc, torch.float16, "Fake GPU", (E, H, N))
    assert report["1"]["config"] == SMALL and report["1"]["tiles"] == "M16_N16_K16_G1_w4_s2"
    assert report["64"]["config"] == SPLIT and report["64"]["backend"] == "grouped_mm"
    assert report["64"]["tiles"] == "M16_N16_K16_G1_w4_s2+down_N32_K16_G1_w4_s2"


# ---------------------------------------------------------------- the measured backend

# grouped_mm measured faster at 2 tokens, triton (BLOCK_N 32) at 16
TWO_BACKENDS = {2: {**SMALL, "ms": 0.3, "grouped_mm_ms": 0.2, "backend": "grouped_mm"},
                16: {**SMALL, "BLOCK_N": 32, "ms": 0.4, "grouped_mm_ms": 0.6, "backend": "triton"}}


def test_measured_runs_the_backend_of_the_nearest_entry(isolated_config_dirs: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    write_tuned(isolated_config_dirs / "env", TWO_BACKENDS)
    spy = Spy(monkeypatch)
    for num_tokens in (1, 9, 10, 33):  # nearest: 2, 2 (a tie), 16, 16
        x, w13, w2, weights, ids = experts_and_tokens(num_tokens, seed=num_tokens)
        out = moe_measured.moe_measured(x, w13, w2, weights, ids)
        torch.testing.assert_close(out, moe_loop_ref(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    assert [(b, n) for b, n, _ in spy.calls] == [("grouped_mm", 1), ("grouped_mm", 9),
                                                 ("triton", 10), ("triton", 33)]
    assert spy.calls[2][2] == dict(SMALL, BLOCK_N=32)  # the entry's tiles, not the defaults


def test_measured_without_a_tune_is_triton_with_default_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    for num_tokens in (0, 3, 33):
        x, w13, w2, weights, ids = experts_and_tokens(num_tokens, seed=7)
        out = moe_measured.moe_measured(x, w13, w2, weights, ids)
        assert out.shape == (num_tokens, H)
        torch.testing.assert_close(out, moe_loop_ref(x, w13, w2, weights, ids),
                                   atol=1e-5, rtol=1e-5)
    assert [(b, n) for b, n, _ in spy.calls] == [("triton", 0), ("triton", 3), ("triton", 33)]
    assert spy.calls[1][2] == moe_configs.fit_shared_memory(
        moe_configs.default_moe_config(E, K, 3), x.element_size())


def test_measured_picks_are_cached_per_shape_and_token_count(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tuned(isolated_config_dirs / "env", {4: {**SMALL, "backend": "grouped_mm"}})
    x, w13, w2, weights, ids = experts_and_tokens(4)
    lookups: list[int] = []
    real = moe_configs.get_moe_config

    def counting(*args: object, **kwargs: object) -> moe_configs.MoeConfigChoice:
        lookups.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_configs, "get_moe_config", counting)
    spy = Spy(monkeypatch)
    for _ in range(3):
        moe_measured.moe_measured(x, w13, w2, weights, ids)
    assert lookups == [4] and [b for b, _, _ in spy.calls] == ["grouped_mm"] * 3
    # a new tune (clear_caches) is seen by the next call
    write_tuned(isolated_config_dirs / "env", {4: {**SMALL, "backend": "triton"}})
    moe_measured.moe_measured(x, w13, w2, weights, ids)
    assert lookups == [4, 4] and spy.calls[-1][0] == "triton"


# ---------------------------------------------------------------- the tile source (moe_tiles)

def default_tiles(num_tokens: int, dtype: torch.dtype = torch.float32) -> dict:
    """What get_moe_config falls back to at this token count (the tiny shape, `dtype`)."""
    return moe_configs.fit_shared_memory(moe_configs.default_moe_config(E, K, num_tokens),
                                         torch.empty((), dtype=dtype).element_size())


def test_default_tiles_leave_a_tuned_file_out(isolated_config_dirs: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tuned(isolated_config_dirs / "env", {
        1: {**SMALL, "backend": "grouped_mm"}, 64: dict(SMALL, BLOCK_M=32)})
    tuned = get_moe_config(E, H, N, K, torch.float32, 1, "cpu", tiles="tuned")
    assert (tuned.tuned, tuned.source, tuned.backend) == (True, str(path), "grouped_mm")

    def no_file(*args: object) -> None:
        raise AssertionError("tiles='default' reads no tuned file")

    monkeypatch.setattr(moe_configs, "find_tuned", no_file)
    for num_tokens in (1, 64, 4096):
        choice = get_moe_config(E, H, N, K, torch.float32, num_tokens, "cpu", tiles="default")
        assert choice == moe_configs.MoeConfigChoice(default_tiles(num_tokens), tuned=False,
                                                     source="default", backend="triton",
                                                     tuned_tokens=None)
    with pytest.raises(ValueError, match=r"MoE tiles must be one of tuned, default; got 'x'"):
        get_moe_config(E, H, N, K, torch.float32, 1, "cpu", tiles="x")


def test_triton_with_default_tiles_launches_the_defaults(isolated_config_dirs: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve.kernels.moe import fused_triton as triton_module

    write_tuned(isolated_config_dirs / "env", {4: dict(SMALL, BLOCK_N=32)})
    launched: list[dict] = []
    real_launch = triton_module._launch

    def launch(*args: object, **kwargs: object) -> None:
        launched.append(args[8])  # the launch's tiles
        real_launch(*args, **kwargs)

    monkeypatch.setattr(triton_module, "_launch", launch)
    x, w13, w2, weights, ids = experts_and_tokens(4, seed=3)
    expected = moe_loop_ref(x, w13, w2, weights, ids)
    for tiles, config in (("tuned", dict(SMALL, BLOCK_N=32)), ("default", default_tiles(4))):
        launched.clear()
        out = triton_module.moe_triton(x, w13, w2, weights, ids, tiles=tiles)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert launched == [config, moe_configs.down_tiles(config)], tiles
    with pytest.raises(ValueError, match="MoE tiles must be one of"):
        triton_module.moe_triton(x, w13, w2, weights, ids, tiles="x")


def test_measured_with_default_tiles_is_triton_and_keeps_its_own_picks(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines in one process, one per tile source: the plan cache is keyed on the source,
    so neither sees the other's pick."""
    write_tuned(isolated_config_dirs / "env", {4: {**SMALL, "backend": "grouped_mm"}})
    spy = Spy(monkeypatch)
    x, w13, w2, weights, ids = experts_and_tokens(4, seed=5)
    expected = moe_loop_ref(x, w13, w2, weights, ids)
    for tiles in ("tuned", "default", "tuned", "default"):
        out = moe_measured.moe_measured(x, w13, w2, weights, ids, tiles=tiles)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert [(b, c) for b, _, c in spy.calls] == [("grouped_mm", None),
                                                 ("triton", default_tiles(4))] * 2


@pytest.mark.parametrize("backend", ["triton", "measured"])
def test_the_capacity_report_says_which_tiles_are_in_use(isolated_config_dirs: Path,
                                                         backend: str) -> None:
    from moeserve.config import EngineConfig, SchedulerConfig
    from moeserve.engine import moe_setup

    path = write_tuned(isolated_config_dirs / "env", {1: SMALL, 64: {**SPLIT, "backend":
                                                                     "grouped_mm"}},
                       device="Fake GPU", dtype=torch.float16)
    mc = SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=N,
                         num_experts_per_tok=K)

    def report(tiles: str) -> dict[str, dict]:
        cfg = EngineConfig(moe_backend=backend, moe_tiles=tiles,
                           scheduler=SchedulerConfig(max_num_batched_tokens=2048))
        return moe_setup.moe_configs(cfg, mc, torch.float16, "Fake GPU", (E, H, N))

    tuned = report("tuned")
    assert all(c["tuned"] and c["source"] == str(path) for c in tuned.values())
    assert tuned["64"]["config"] == SPLIT
    assert tuned["64"]["backend"] == ("grouped_mm" if backend == "measured" else "triton")
    default = report("default")
    assert list(default) == ["1", "64", "256", "1024", "2048"]
    for n, c in default.items():
        config = default_tiles(int(n), torch.float16)
        assert c == {"config": config, "tiles": moe_configs.config_key(config), "tuned": False,
                     "source": "default", "backend": "triton", "tuned_tokens": None}


# ---------------------------------------------------------------- the tuner

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
SPLIT = {**dict(SMALL, BLOCK_N=16), "down": {k: SMALL[k] for k in moe_configs.DOWN_KEYS}
         | {"BLOCK_N": 32}}  # the fake timers' pick: gated BLOCK_N 16, down BLOCK_N 32
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


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_measured_in_a_cuda_graph_without_sync() -> None:
    """Both picks at the qwen3-30b-a3b shape: no host sync, graph replay equals eager."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).bfloat16()
    device = torch.cuda.get_device_name()
    tmp = Path(moe_configs.tune_dir())
    tmp.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {}, "configs": {
        "64": {**moe_configs.default_moe_config(e, k, 64), "backend": "grouped_mm"},
        "256": {**moe_configs.default_moe_config(e, k, 256), "backend": "triton"}}}
    (tmp / config_file_name(e, h, i, torch.bfloat16, device)).write_text(json.dumps(doc))
    moe_configs.clear_caches()
    for num_tokens in (64, 256):
        x = torch.randn(num_tokens, h, device="cuda", generator=gen).bfloat16()
        weights, ids = select_experts(torch.randn(num_tokens, e, device="cuda", generator=gen),
                                      k, renormalize=True)
        eager = moe_measured.moe_measured(x, w13, w2, weights, ids)  # compile, pick
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe_measured.moe_measured(x, w13, w2, weights, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = moe_measured.moe_measured(x, w13, w2, weights, ids)
        graph.replay()
        torch.testing.assert_close(static, eager)  # bf16 defaults: the same kernels, replayed
        expected = moe_loop_ref(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(eager.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64, 1024, 8192])
def test_default_tiles_fit_shared_memory_in_every_dtype(dtype: torch.dtype,
                                                        num_tokens: int) -> None:
    """fp32 at a long prompt once asked for 240 KiB of shared memory (over the H200's 227)."""
    from moeserve.kernels.moe.tile_configs import SHARED_MEMORY_BUDGET, get_moe_config

    c = get_moe_config(8, 64, 32, 2, dtype, num_tokens, "no such device").config
    elem = torch.empty((), dtype=dtype).element_size()
    need = (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * elem * c["num_stages"]
    assert need <= SHARED_MEMORY_BUDGET, c
