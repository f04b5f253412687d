"""Triton fused MoE: tile configs (the lookup, the defaults, launch options) and the tuner
(resumable, failures recorded, launches timed apart), on tiny shapes through Triton's
interpreter without a GPU (test_moe_triton.py: the kernel itself).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moeserve.kernels.moe import search as moe_search
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe import timer as moe_timer
from moeserve.kernels.moe.align import moe_align_block_size_triton
from moeserve.kernels.moe.search import candidate_key, trial_key
from moeserve.kernels.moe.tile_configs import config_file_name, get_moe_config
from moeserve.kernels.moe.tune import tune_moe
from tests.kernels.moe.test_moe_triton import (
    HIDDEN,
    INTER,
    SMALL,
    SPLIT,
    assert_matches_ref,
    make_experts,
)


def test_default_config_grows_with_tokens_per_expert() -> None:
    small = get_moe_config(128, 2048, 768, 8, torch.bfloat16, 64, "cpu")
    large = get_moe_config(128, 2048, 768, 8, torch.bfloat16, 4096, "cpu")
    assert not small.tuned and small.source == "default"
    assert small.config["BLOCK_M"] == 16 and large.config["BLOCK_M"] >= 64
    assert set(small.config) == set(moe_configs.CONFIG_KEYS)


def test_tuned_file_is_found_and_nearest_token_count_wins(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    name = config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    assert name.startswith("E=8,H=64,I=32,device_name=Fake_GPU,dtype=float16,triton=")
    cfg16 = dict(SMALL, BLOCK_M=16)
    cfg64 = dict(SMALL, BLOCK_M=64)
    doc = {"meta": {}, "configs": {"16": {**cfg16, "ms": 1.0}, "512": {**cfg64, "ms": 2.0}}}
    (tmp_path / name).write_text(json.dumps(doc))
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    near16 = get_moe_config(8, 64, 32, 2, torch.float16, 100, "Fake GPU")
    assert near16.tuned and near16.config == cfg16 and near16.source == str(tmp_path / name)
    assert get_moe_config(8, 64, 32, 2, torch.float16, 400, "Fake GPU").config == cfg64
    assert not get_moe_config(8, 64, 32, 2, torch.bfloat16, 100, "Fake GPU").tuned


class Killed(BaseException):
    """Stands for the process being killed mid-tune (not an Exception: not skipped)."""


def test_tune_records_failures_resumes_and_feeds_the_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grid = [dict(SMALL, BLOCK_N=n, num_stages=s) for n in (16, 32, 64) for s in (2, 3)]
    calls: list[tuple[str, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((trial_key(part, config), num_tokens))
        if len(calls) == 16 and not resumed:  # T=16's 14 timings, then T=256's align
            raise Killed
        if part == "moe":
            return 1.5 + num_tokens / 1000
        if part == "align":
            return 0.01
        if config["BLOCK_N"] == 64:
            raise RuntimeError("out of resource: shared memory")
        if part == "gated":  # best: BLOCK_N 16, 2 stages, in one dot
            return (config["BLOCK_N"] / 16 + config["num_stages"] / 100 + num_tokens / 1000
                    - config.get("ONE_DOT", 0) / 200)
        # down, best: BLOCK_N 32, 3 stages
        return (abs(config["BLOCK_N"] - 32) / 16 + (5 - config["num_stages"]) / 100
                + num_tokens / 1000)

    path = tmp_path / config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    args = (8, 64, 32, 2, torch.float16, [16, 256], path)
    resumed = False
    with pytest.raises(Killed):
        tune_moe(*args, candidates=lambda n: grid, timer=timer, device_name="Fake GPU",
                 log=lambda s: None)
    doc = json.loads(path.read_text())
    # align, 6 gated and 6 down tiles, the whole op (4 pairs per expert: no launch options)
    assert len(doc["trials"]["16"]) == 1 + 2 * 6 + 1 and len(doc["trials"]["256"]) == 1
    assert "16" in doc["configs"] and "256" not in doc["configs"]
    assert sum(isinstance(v, str) for v in doc["trials"]["16"].values()) == 4  # BLOCK_N 64

    resumed, calls[:] = True, []
    best = tune_moe(*args, candidates=lambda n: grid, timer=timer, device_name="Fake GPU",
                    log=lambda s: None)
    down = dict(grid[3], BLOCK_N=32, num_stages=3)
    split = moe_configs.split_config({**grid[0], "ONE_DOT": 1}, down)
    # 64 pairs per expert: each gated tile also in one dot (search_options)
    assert calls == ([(trial_key("gated", c), 256) for c in grid]  # only the rest: no align
                     + [(trial_key("gated", {**c, "ONE_DOT": 1}), 256) for c in grid]
                     + [(trial_key("down", c), 256) for c in grid]
                     + [(trial_key("moe", split), 256)])
    assert best[256]["BLOCK_N"] == 16 and best[256]["num_stages"] == 2
    assert best[256]["ONE_DOT"] == 1 and trial_key("moe", split).endswith(
        "_s2_1dot+down_N32_K16_G2_w4_s3")
    assert best[256]["down"] == {k: down[k] for k in moe_configs.DOWN_KEYS}
    assert best[256]["ms"] == pytest.approx(1.5 + 0.256)  # the whole op's time
    doc = json.loads(path.read_text())
    assert doc["meta"]["device_name"] == "Fake GPU" and doc["meta"]["top_k"] == 2
    assert doc["meta"]["triton"] == moe_configs.triton_version()
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    choice = get_moe_config(8, 64, 32, 2, torch.float16, 300, "Fake GPU")
    assert choice.tuned and choice.config == split == moe_configs.entry_config(best[256])

    with pytest.raises(ValueError, match="holds a tune of"):
        tune_moe(8, 64, 32, 4, torch.float16, [16], path, timer=timer, device_name="Fake GPU")


def test_tune_fails_clearly_when_every_candidate_fails(tmp_path: Path) -> None:
    def timer(part: str, config: dict, num_tokens: int) -> float:
        if part == "align":
            return 0.01
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="every candidate failed at 16 tokens"):
        tune_moe(8, 64, 32, 2, torch.float16, [16], tmp_path / "t.json",
                 candidates=lambda n: [SMALL], timer=timer, log=lambda s: None)


def test_tune_times_the_launches_apart_and_combines_their_best_tiles(tmp_path: Path) -> None:
    """Per BLOCK_M: one align, each tile for the gated launch and for the down launch; the best
    of each combine, the least total BLOCK_M wins, and only that pick is timed whole."""
    tiles = [dict(SMALL, BLOCK_M=m, BLOCK_N=n) for m in (16, 32) for n in (16, 32, 64)]
    align_ms = {16: 0.02, 32: 0.01}
    # (part, BLOCK_M) -> {BLOCK_N: ms}: at T=8 the gated launch likes N16 at M16 and N64 at
    # M32 (its best tile of all), the down launch N32 at both; N64 fails the gated launch at
    # M16 but runs the down one. At T=64 both launches like N16 at M16: no "down" entry.
    ms = {8: {("gated", 16): {16: 0.08, 32: 0.09},
              ("gated", 32): {16: 0.12, 32: 0.11, 64: 0.07},
              ("down", 16): {16: 0.12, 32: 0.10, 64: 0.30},
              ("down", 32): {16: 0.25, 32: 0.20, 64: 0.40}},
          64: {("gated", 16): {16: 0.1, 32: 0.2},
               ("gated", 32): {16: 0.3, 32: 0.3, 64: 0.3},
               ("down", 16): {16: 0.1, 32: 0.2, 64: 0.2},
               ("down", 32): {16: 0.3, 32: 0.3, 64: 0.3}}}
    calls: list[tuple[str, dict, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((part, config, num_tokens))
        if part == "align":
            return align_ms[config["BLOCK_M"]]
        if part == "moe":
            return 0.5
        table = ms[num_tokens][part, config["BLOCK_M"]]
        if config["BLOCK_N"] not in table:
            raise RuntimeError("out of resource: shared memory")
        return table[config["BLOCK_N"]]

    path = tmp_path / "t.json"
    best = tune_moe(8, 64, 32, 2, torch.float32, [8, 64], path, candidates=lambda n: tiles,
                    timer=timer, device_name="cpu", log=lambda s: None)
    at8 = [(part, c) for part, c, n in calls if n == 8]
    assert [c["BLOCK_M"] for part, c in at8 if part == "align"] == [16, 32]  # once per BLOCK_M
    for part in ("gated", "down"):  # each tile once per launch, then (above BLOCK_M 16) the
        timed = [c for p, c in at8 if p == part]  # best with the other GROUP_M and with SUB_M
        first = tiles[5 if part == "gated" else 4]  # the first round's best at M32
        assert timed == [*tiles, dict(first, GROUP_M=1), dict(first, SUB_M=1)]
    assert len(at8) == 2 + 2 * len(tiles) + 4 + 1  # not one timing per (gated, down) pair
    # M16: 0.02 + 0.08 (gated N16) + 0.10 (down N32) = 0.20 beats M32: 0.01 + 0.07 + 0.20
    down = {k: SMALL[k] for k in moe_configs.DOWN_KEYS} | {"BLOCK_N": 32}
    split = {**dict(SMALL, BLOCK_N=16), "down": down}
    assert [(p, c) for p, c in at8 if p == "moe"] == [("moe", split)]
    assert best[8] == {**split, "ms": 0.5, "backend": "triton"}
    assert best[64] == {**dict(SMALL, BLOCK_N=16), "ms": 0.5, "backend": "triton"}
    doc = json.loads(path.read_text())
    assert doc["configs"]["8"]["down"] == down and "down" not in doc["configs"]["64"]
    trials = doc["trials"]["8"]
    assert trials["gated:M16_N64_K16_G2_w4_s2"].startswith("error: RuntimeError")
    assert trials["down:M16_N64_K16_G2_w4_s2"] == 0.30
    assert trials["align:M32"] == 0.01 and trials[trial_key("moe", split)] == 0.5
    assert moe_search.best_split(moe_search.tiles_by_block_m(tiles), trials) == (
        split, pytest.approx(0.20))


def test_tune_tries_launch_options_by_pairs_per_expert(tmp_path: Path) -> None:
    """ONE_DOT from 32 pairs per expert, the PERSISTENT round from 128 on the first round's best
    tile of each launch; the entry keeps an option only where it was faster, and the lookup
    hands it to moe_triton (config_key names it)."""
    tiles = [dict(SMALL, BLOCK_N=n) for n in (16, 32)]
    calls: list[tuple[str, int]] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append((trial_key(part, config), num_tokens))
        if part in ("align", "moe"):
            return 0.01
        ms = 1.0 + config["BLOCK_N"] / 100 - config.get("ONE_DOT", 0) / 10
        # one program per SM: faster for the down launch, slower for the gated one
        return ms + config.get("PERSISTENT", 0) * (0.05 if part == "gated" else -0.02)

    assert moe_search.search_options(8, 2, 64) == (False, False)  # 16 per expert
    assert moe_search.search_options(8, 2, 128) == (True, False)  # 32
    assert moe_search.search_options(8, 2, 512) == (True, True)  # 128
    best = tune_moe(8, 64, 32, 2, torch.float32, [64, 512], tmp_path / "t.json",
                    candidates=lambda n: tiles, timer=timer, log=lambda s: None)
    at64 = [k for k, n in calls if n == 64]
    assert not [k for k in at64 if "_1dot" in k or "_p" in k]
    assert best[64] == {**tiles[0], "ms": 0.01, "backend": "triton"}
    at512 = [k for k, n in calls if n == 512]
    one_dot = {**tiles[0], "ONE_DOT": 1}
    down = {k: tiles[0][k] for k in moe_configs.DOWN_KEYS}
    assert at512 == ["align:M16", *[trial_key("gated", c) for c in tiles],
                     *[trial_key("gated", {**c, "ONE_DOT": 1}) for c in tiles],
                     trial_key("gated", {**one_dot, "PERSISTENT": 1}),
                     trial_key("gated", {**one_dot, "PERSISTENT": 2}),
                     *[trial_key("down", c) for c in tiles],
                     trial_key("down", {**tiles[0], "PERSISTENT": 1}),
                     trial_key("down", {**tiles[0], "PERSISTENT": 2}),
                     trial_key("moe", moe_configs.split_config(
                         one_dot, {**tiles[0], "PERSISTENT": 2}))]
    assert best[512] == {**one_dot, "down": {**down, "PERSISTENT": 2}, "ms": 0.01,
                         "backend": "triton"}
    assert moe_configs.config_key(moe_configs.entry_config(best[512])) == (
        "M16_N16_K16_G2_w4_s2_1dot+down_N16_K16_G2_w4_s2_p2")
    assert moe_configs.down_tiles(best[512]) == {**tiles[0], "PERSISTENT": 2}


def test_launch_options_in_configs_split_and_parse() -> None:
    """split_config keeps a launch's options (a "down" entry appears when only PERSISTENT
    differs), parse_entry reads them from JSON, and a bad one is named."""
    gated = {**SMALL, "ONE_DOT": 1, "PERSISTENT": 1}
    same = moe_configs.split_config(gated, {**SMALL, "PERSISTENT": 1})
    assert same == gated and moe_configs.down_tiles(same) == {**SMALL, "PERSISTENT": 1}
    apart = moe_configs.split_config(gated, SMALL)  # the down launch: one program per tile
    assert apart["down"] == {k: SMALL[k] for k in moe_configs.DOWN_KEYS}
    assert moe_configs.down_tiles(apart) == SMALL
    assert moe_configs.split_config({**SMALL, "ONE_DOT": 0}, SMALL) == SMALL  # 0: absent
    raw = {**{k: str(v) for k, v in gated.items()}, "backend": "triton"}
    assert moe_configs.entry_config(moe_configs.parse_entry(raw)) == gated
    with pytest.raises(ValueError, match="PERSISTENT must be an int in \\[0, 8\\]"):
        moe_configs.check_config({**SMALL, "down": {**apart["down"], "PERSISTENT": 9}})


def test_a_failing_align_skips_its_block_m(tmp_path: Path) -> None:
    tiles = [dict(SMALL, BLOCK_M=m) for m in (16, 32)]
    calls: list[str] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append(trial_key(part, config))
        if part == "align" and config["BLOCK_M"] == 16:
            raise RuntimeError("align failed")
        return 0.1

    best = tune_moe(8, 64, 32, 2, torch.float32, [8], tmp_path / "t.json",
                    candidates=lambda n: tiles, timer=timer, log=lambda s: None)
    assert best[8]["BLOCK_M"] == 32 and "down" not in best[8]
    assert calls == ["align:M16", "align:M32"] + [
        trial_key(part, c) for part in ("gated", "down")
        for c in (tiles[1], dict(tiles[1], GROUP_M=1), dict(tiles[1], SUB_M=1))] + [
        trial_key("moe", tiles[1])]


def test_an_older_tune_still_loads_and_is_retimed_by_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the committed files: every entry loads, its tiles and at most a "down" of its own
    for path in sorted(moe_configs.PACKAGE_CONFIG_DIR.glob("*.json")):
        table = moe_configs._load_tuned(str(path))
        assert table
        for entry in table.values():
            config = moe_configs.entry_config(entry)
            assert set(moe_configs.CONFIG_KEYS) <= set(config) <= {
                *moe_configs.CONFIG_KEYS, *moe_configs.OPTION_KEYS, "down"}
            down = moe_configs.down_tiles(config)
            assert set(moe_configs.CONFIG_KEYS) <= set(down) <= {
                *moe_configs.CONFIG_KEYS, *moe_configs.DOWN_OPTION_KEYS}
            assert down["BLOCK_M"] == config["BLOCK_M"]
            # a "down" entry only where the down launch's tiles differ from those it would
            # take from the top level (an option set there, e.g. PERSISTENT, counts)
            inherited = moe_configs.down_tiles({k: v for k, v in config.items() if k != "down"})
            assert ("down" in config) == (down != inherited)
    # an older tuner's file: plain candidate keys in its ledger, whole-op times
    old = dict(SMALL, BLOCK_N=32)
    doc = {"meta": {"device_name": "Fake GPU", "dtype": "float16", "E": 8, "H": 64, "I": 32,
                    "top_k": 2, "triton": moe_configs.triton_version()},
           "configs": {"16": {**old, "ms": 0.3, "backend": "triton"},
                       "256": {**old, "ms": 0.9}},
           "trials": {"16": {candidate_key(old): 0.3}, "256": {candidate_key(old): 0.9}},
           "grouped_mm": {"16": 0.5}}
    path = tmp_path / config_file_name(8, 64, 32, torch.float16, "Fake GPU")
    path.write_text(json.dumps(doc))
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    moe_configs.clear_caches()
    choice = get_moe_config(8, 64, 32, 2, torch.float16, 200, "Fake GPU")
    assert choice.tuned and choice.config == old and choice.tuned_tokens == 256
    # resuming it at 16 tokens times the parts, keeps the old ledger entries and the 256 entry
    calls: list[str] = []

    def timer(part: str, config: dict, num_tokens: int) -> float:
        calls.append(trial_key(part, config))
        return 0.1

    best = tune_moe(8, 64, 32, 2, torch.float16, [16], path, candidates=lambda n: [SMALL],
                    timer=timer, device_name="Fake GPU", log=lambda s: None)
    assert calls == ["align:M16", trial_key("gated", SMALL), trial_key("down", SMALL),
                     trial_key("moe", SMALL)]
    assert best[16] == {**SMALL, "ms": 0.1, "backend": "triton", "grouped_mm_ms": 0.5}
    assert best[256] == {**old, "ms": 0.9, "backend": "triton"}
    assert json.loads(path.read_text())["trials"]["16"][candidate_key(old)] == 0.3


def test_tune_grid_is_modest_and_fits_tokens_per_expert() -> None:
    for num_tokens in (64, 256, 1024, 2048):
        grid = moe_search.moe_tune_candidates(128, 8, num_tokens)
        assert 20 <= len(grid) <= 150
        assert len({candidate_key(c) for c in grid}) == len(grid)
    assert {c["BLOCK_M"] for c in moe_search.moe_tune_candidates(128, 8, 64)} == {16}


def test_the_cuda_timer_runs_each_part_as_moe_triton_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default timer's parts, run once each (time_in_graph replaced; on CPU through the
    interpreter): the gated part writes silu(gate) * up for every pair, the down part the
    weighted rows, and the whole op is moe_triton with the (split) config."""
    ran: list[object] = []

    def run_once(fn: Callable[[], object], calls: int, replays: int) -> float:
        ran.append(fn())
        return 1.0

    monkeypatch.setattr(moe_timer, "time_in_graph", run_once)
    w13, w2 = make_experts(8, torch.float32)
    timer = moe_timer.CudaPartTimer(8, HIDDEN, INTER, 2, torch.float32, (w13, w2))
    x, weights, ids, act, out = timer.inputs(5)
    assert timer("align", {"BLOCK_M": 16}, 5) == 1.0
    assert torch.equal(ran[-1][0], moe_align_block_size_triton(ids, 8, 16)[0])
    timer("gated", SMALL, 5)
    gate_up = torch.einsum("th,tkih->tki", x, w13[ids])  # [T, k, 2I]
    expected_act = torch.nn.functional.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]
    torch.testing.assert_close(act, expected_act.reshape(10, INTER), atol=1e-5, rtol=1e-5)
    timer("down", dict(SMALL, BLOCK_N=32, BLOCK_K=16), 5)
    expected = torch.einsum("pi,phi->ph", act, w2[ids.flatten()]) * weights.reshape(10, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    timer("moe", SPLIT, 5)
    assert_matches_ref(ran[-1], x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="part must be one of"):
        timer("combine", SMALL, 5)
