"""The quantized fused MoE's tune (kernels/moe/quant/tune.py): the candidate grid keeps each
format's BLOCK_K rule, the ledger resumes (never another weight layout's), the time budget stops
the tune, the pick is the fastest. `ensure_quant_tuned` and the engine's start-up line are
test_moe_quant_tune_startup.py's; the lookup's tests are test_moe_quant_lookup.py.

Fake timers (and a fake clock) stand in for the CUDA ones: the tests assert behaviour, never a
wall-clock time. The few real kernel runs go through Triton's interpreter on tiny shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.quant import configs as quant_configs
from moeserve.kernels.moe.quant import fused_triton as fused_quant_triton
from moeserve.kernels.moe.quant import tune as quant_tune
from moeserve.kernels.moe.quant.configs import (
    MAX_QUANT_CANDIDATES,
    check_quant_config,
    default_quant_config,
    get_quant_config,
    quant_config_file_name,
    quant_tune_candidates,
)
from moeserve.kernels.moe.quant.ref import moe_quant_ref
from moeserve.kernels.moe.quant.tune import ensure_quant_tuned, random_quant_experts
from moeserve.kernels.moe.search import trial_key
from moeserve.kernels.moe.tile_configs import config_key, engine_token_counts, tile_config
from moeserve.kernels.moe.timer import random_tokens

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py

E, H, N, K = 4, 64, 32, 2  # tiny experts: count, hidden, width, top-k
SMALL = tile_config(16, 32, 32, 1, 4, 2)  # a W4A16 tile the interpreter runs fast (group 16)
# format -> group: nvfp4's is fixed (16), fp8's 128; int4 takes the checkpoint's
GROUPS = {"fp8": 128, "nvfp4": 16, "int4": 32}




def fake_timer(ms_of: dict[str, float] | None = None, fail: frozenset[str] | set[str] = frozenset()
               ) -> tuple[list[tuple[str, int]], quant_tune.QuantTimerFn]:
    """(calls, timer): the timer records (config key, tokens) and returns ms_of[key] (else a
    number fixed by the key); raises for keys in `fail`."""
    calls: list[tuple[str, int]] = []

    def timer(config: dict, num_tokens: int) -> float:
        key = config_key(config)
        calls.append((key, num_tokens))
        if key in fail:
            raise RuntimeError("out of resources: shared memory")
        if ms_of is not None and key in ms_of:
            return ms_of[key]
        return 1.0 + (sum(map(ord, key)) % 97) / 100 + num_tokens / 1000

    return calls, timer


def tune(fmt: str, path: Path, counts: list[int], timer: quant_tune.QuantTimerFn,
         **kwargs: object) -> dict[int, dict]:
    return quant_tune.tune_quant_moe(fmt, E, H, N, K, GROUPS[fmt], torch.float32, counts, path,
                                     timer=timer, device_name="cpu", log=lambda s: None,
                                     **kwargs)


def write_tuned(directory: Path, fmt: str, entries: dict[int, dict],
                device: str = "cpu") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / quant_config_file_name(fmt, E, H, N, K, GROUPS[fmt], torch.float32,
                                              device)
    path.write_text(json.dumps({"meta": {}, "configs": {str(n): e for n, e in entries.items()}}))
    moe_configs.clear_caches()
    return path


# ---------------------------------------------------------------- the grid

@pytest.mark.parametrize(("fmt", "group"), [("fp8", 128), ("nvfp4", 16), ("int4", 32),
                                            ("int4", 128), ("int4", 256)])
@pytest.mark.parametrize(("num_experts", "top_k"), [(128, 8), (256, 8), (8, 2)])
def test_the_grid_is_valid_for_each_format(fmt: str, group: int, num_experts: int,
                                           top_k: int) -> None:
    counts = engine_token_counts(8192)
    for num_tokens in counts:
        grid = quant_tune_candidates(fmt, num_experts, top_k, num_tokens, group)
        assert 1 < len(grid) <= MAX_QUANT_CANDIDATES
        assert grid[0] == default_quant_config(fmt, num_tokens, top_k, num_experts, group)
        assert len({config_key(c) for c in grid}) == len(grid)
        per_expert = num_tokens * top_k / num_experts
        for c in grid:
            check_quant_config(c, fmt, (group,))  # raises on a bad BLOCK_K
            assert c["BLOCK_K"] == 128 if fmt == "fp8" else c["BLOCK_K"] % group == 0
            assert c["BLOCK_M"] in (16, 32, 64, 128) and c["BLOCK_N"] in (32, 64, 128, 256)
            assert c["num_warps"] in (4, 8) and 2 <= c["num_stages"] <= 4
            assert c["GROUP_M"] in (1, 8)
            if fmt == "nvfp4" and c["num_warps"] == 8:  # 8 warps only for 128 rows
                assert c["BLOCK_M"] == 128, c
        assert {c["BLOCK_M"] for c in grid[1:]} <= {m for m in (16, 32, 64, 128)
                                                  if m <= max(16, 2 * per_expert)}
        # each BLOCK_M from 32 with SUB_M (the 4-bit default has it too), beside tiles without
        subs = [c for c in grid if c.get("SUB_M")]
        assert {c["BLOCK_M"] for c in subs} == {c["BLOCK_M"] for c in grid
                                                if c["BLOCK_M"] >= 32}
        assert all({k: v for k, v in c.items() if k != "SUB_M"} in grid for c in subs
                   if c is not grid[0])
        assert all(c["BLOCK_M"] >= 32 for c in grid if c.get("SUB_M"))
        # from 64 rows a gated BLOCK_N 64 tile beside a down launch of BLOCK_N 128
        splits = [c for c in grid if "down" in c]
        assert all(c["BLOCK_M"] >= 64 and c["BLOCK_N"] == 64
                   and c["down"]["BLOCK_N"] == 128 for c in splits)
        if max(c["BLOCK_M"] for c in grid) >= 64 and fmt != "fp8":
            assert splits, grid
    decode = quant_tune_candidates(fmt, num_experts, top_k, 1, group)
    assert {c["BLOCK_M"] for c in decode} == {16}  # one row block per expert
    if num_experts >= 128:  # 8192 tokens: 256-512 pairs per expert
        assert {c["BLOCK_M"] for c in quant_tune_candidates(fmt, num_experts, top_k, 8192,
                                                            group)[1:]} == {64, 128}


@pytest.mark.parametrize(("fmt", "group"), [("nvfp4", 16), ("int4", 32), ("int4", 128)])
def test_long_k_dims_take_the_wide_k_step_in_decode(fmt: str, group: int) -> None:
    wide, narrow = (6144, 2048), (2048, 768)  # GLM-5's experts (H, I), qwen3-30b-a3b's
    decode = default_quant_config(fmt, 64, 8, 256, group, wide)
    assert decode == tile_config(16, 64, quant_configs.WIDE_K, 1, 4, 3)
    assert default_quant_config(fmt, 64, 8, 128, group, narrow)["BLOCK_K"] == 128
    assert default_quant_config(fmt, 64, 8, 256, group)["BLOCK_K"] == 128  # dims unknown
    assert default_quant_config(fmt, 8192, 8, 256, group, wide)["BLOCK_K"] == 128  # prefill
    assert default_quant_config("fp8", 64, 8, 256, 128, wide)["BLOCK_K"] == 128
    grid = quant_tune_candidates(fmt, 256, 8, 64, group, wide)
    assert grid[0] == decode and {c["BLOCK_K"] for c in grid} == {128, 256}
    assert {c["BLOCK_K"] for c in quant_tune_candidates(fmt, 128, 8, 64, group)} == {128, 256}
    choice = get_quant_config(fmt, 256, *wide, 8, group, torch.bfloat16, 64, "cpu",
                              tiles="default")  # the lookup passes the shape's K dims
    assert choice.config == decode


def test_the_grid_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown quantized format 'int8'"):
        quant_tune_candidates("int8", E, K, 1, 32)


def test_a_bad_candidate_is_refused_before_any_timing(tmp_path: Path) -> None:
    calls, timer = fake_timer()
    bad = tile_config(16, 32, 64, 1, 4, 2)
    with pytest.raises(ValueError, match="fp8 needs BLOCK_K 128"):
        tune("fp8", tmp_path / "t.json", [1], timer, candidates=lambda n: [bad])
    assert calls == []


# ---------------------------------------------------------------- the tuner

def test_the_pick_is_the_fastest_and_the_default_is_timed(tmp_path: Path) -> None:
    grid = quant_tune_candidates("nvfp4", E, K, 4, 16)
    fastest = grid[5]
    ms_of = {config_key(c): 2.0 + i / 10 for i, c in enumerate(grid)}
    ms_of[config_key(fastest)] = 0.5
    calls, timer = fake_timer(ms_of)
    done = tune("nvfp4", tmp_path / "t.json", [4], timer)
    assert len(calls) == len(grid)  # each candidate once
    entry = done[4]
    assert {k: entry[k] for k in moe_configs.CONFIG_KEYS} == fastest
    assert entry["ms"] == 0.5 and entry["default_ms"] == 2.0  # grid[0]: the default's time
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["meta"]["format"] == "nvfp4" and doc["meta"]["group"] == 16
    assert doc["trials"]["4"][trial_key("moe", fastest)] == 0.5


def test_ties_keep_the_first_and_failures_are_skipped(tmp_path: Path) -> None:
    grid = quant_tune_candidates("int4", E, K, 1, 32)
    failing = config_key(grid[0])
    calls, timer = fake_timer({config_key(c): 1.0 for c in grid}, fail={failing})
    done = tune("int4", tmp_path / "t.json", [1], timer)
    assert {k: done[1][k] for k in moe_configs.CONFIG_KEYS} == grid[1]  # the first timed
    assert "default_ms" not in done[1]  # the default failed
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["trials"]["1"][trial_key("moe", grid[0])].startswith("error: RuntimeError")
    _, all_fail = fake_timer(fail={config_key(c) for c in grid})
    with pytest.raises(RuntimeError, match="every int4 candidate failed at 1 tokens"):
        tune("int4", tmp_path / "u.json", [1], all_fail)


def test_the_ledger_resumes_and_a_rerun_times_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    calls, timer = fake_timer()
    first = tune("fp8", path, [1, 16], timer)
    timed = len(calls)
    assert timed == sum(len(quant_tune_candidates("fp8", E, K, n, 128)) for n in (1, 16))
    calls.clear()
    again = tune("fp8", path, [1, 16], timer)
    assert calls == [] and again == first
    more = tune("fp8", path, [1, 16, 64], timer)  # only the new token count is timed
    assert {n for _, n in calls} == {64} and set(more) == {1, 16, 64}
    with pytest.raises(ValueError, match="holds a tune of"):  # another format, same file
        tune("nvfp4", path, [1], timer)


def test_a_ledger_of_the_other_weight_layout_is_not_resumed(tmp_path: Path) -> None:
    """Rows and micro-tiles time the same tiles differently: a micro-tiled tune refuses a rows
    ledger, and a ledger without the layout (from before micro-tiles) counts as rows."""
    path = tmp_path / "t.json"
    _, timer = fake_timer()
    tune("nvfp4", path, [1], timer)  # CPU shapes: rows (fits_shape needs K % 128)
    doc = json.loads(path.read_text())
    assert doc["meta"]["weight_layout"] == "rows"
    w13, w2 = random_quant_experts("nvfp4", E, H, N, 16, torch.float32, torch.device("cpu"))
    w13.micro_tiled = True  # as the engine marks them (the timer here is fake)
    with pytest.raises(ValueError, match="in the rows layout, not micro"):
        tune("nvfp4", path, [1], timer, weights=(w13, w2))
    del doc["meta"]["weight_layout"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="in the rows layout, not micro"):
        tune("nvfp4", path, [1], timer, weights=(w13, w2))
    assert tune("nvfp4", path, [1], timer)  # rows again: resumed


def test_the_time_budget_stops_the_tune_and_a_rerun_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(quant_tune, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    calls, fast = fake_timer()

    def timer(config: dict, num_tokens: int) -> float:
        clock.now += 1.0  # each timing costs a second of the tune's clock
        return fast(config, num_tokens)

    path = tmp_path / "t.json"
    done = tune("nvfp4", path, [1, 4], timer, time_budget_s=2.5)
    assert len(calls) == 3 and done == {}  # stopped before the 4th timing, nothing finished
    trials = json.loads(path.read_text())["trials"]["1"]
    assert len(trials) == 3  # the ledger holds what was timed
    first = list(calls)
    calls.clear()
    done = tune("nvfp4", path, [1, 4], timer)  # no budget: finishes, timing nothing twice
    assert set(done) == {1, 4} and not set(first) & set(calls)
    calls.clear()
    assert tune("nvfp4", path, [1, 4, 8], timer, time_budget_s=0) == done and calls == []


def test_random_tokens_and_quant_experts_feed_the_real_timer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the CUDA timer on CPU weights, with time_in_graph replaced by one eager call: the op it
    # times is moe_quant_triton on the random quantized experts, with the candidate's tiles
    ran: list[torch.Tensor] = []
    monkeypatch.setattr(quant_tune, "time_in_graph",
                        lambda fn, calls, replays: ran.append(fn()) or 0.25)
    for fmt in ("nvfp4", "fp8"):
        ran.clear()
        w13, w2 = random_quant_experts(fmt, E, H, N, GROUPS[fmt], torch.float32,
                                       torch.device("cpu"))
        assert w13.shape == (E, 2 * N, H) and w2.shape == (E, H, N)
        assert (w13.scale_rows == 128) == (fmt == "fp8")  # as the engine holds fp8 scales
        timer = quant_tune.QuantTimer(fmt, E, H, N, K, GROUPS[fmt], torch.float32, (w13, w2))
        config = SMALL if fmt == "nvfp4" else tile_config(16, 32, 128, 1, 4, 2)
        assert timer(config, 3) == 0.25
        x, weights, ids = random_tokens(3, H, E, K, torch.float32, torch.Generator().manual_seed(0))
        assert ran[0].shape == (3, H) and ids.shape == (3, K) and weights.dtype == torch.float32
        expected = moe_quant_ref(*timer._inputs[3][:1], w13, w2, *timer._inputs[3][1:])
        torch.testing.assert_close(ran[0], expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(GROUPS))
def test_gpu_a_small_real_tune_writes_a_file_the_kernel_reads(fmt: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The CUDA timer end to end (random quantized experts, CUDA-graph timings) on a small
    shape, the grid at 2 token counts (1 and 2); moe_quant_triton then runs the tuned tiles.
    In NVFP4 and INT4 the shape fits micro-tiles, so the tune times them (the engine's layout
    on CUDA) and its file is the micro layout's, which micro-tiled experts look up (FP8 has
    rows only)."""
    from moeserve.kernels.moe.quant.micro_tiles import fits_shape, tile_in_place

    monkeypatch.delenv(moe_configs.CONFIG_DIR_ENV)
    e, h, i, k, group = 16, 512, 256, 4, GROUPS[fmt]
    micro = fits_shape(fmt, h, i)
    assert micro == (fmt != "fp8")
    done = ensure_quant_tuned(fmt, e, h, i, k, group, torch.bfloat16, 2, log=lambda s: None)
    assert done.tuned and done.detail.startswith("tuned now: 2 of 2")
    assert (",layout=micro," in Path(done.source).name) == micro
    doc = json.loads(Path(done.source).read_text())
    assert all(isinstance(v, float) for t in doc["trials"].values() for v in t.values())
    device = moe_configs.tile_device_name(torch.device("cuda"))
    choice = get_quant_config(fmt, e, h, i, k, group, torch.bfloat16, 2, device, micro=micro)
    assert choice.tuned and choice.source == done.source
    if micro:  # the rows layout has no file: its defaults
        assert not get_quant_config(fmt, e, h, i, k, group, torch.bfloat16, 2, device).tuned
    w13, w2 = random_quant_experts(fmt, e, h, i, group, torch.bfloat16, torch.device("cuda"))
    x, weights, ids = random_tokens(2, h, e, k, torch.bfloat16,
                                    torch.Generator(device="cuda").manual_seed(0))
    expected = moe_quant_ref(x, w13, w2, weights, ids).float()  # the reference reads rows
    for w in (w13, w2) if micro else ():
        tile_in_place(w)
    out = fused_quant_triton.moe_quant_triton(x, w13, w2, weights, ids)
    assert float((out.float() - expected).abs().max() / expected.abs().max()) < 2e-2



PACKAGE_CONFIGS = Path(quant_configs.__file__).parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(PACKAGE_CONFIGS.glob("quant=*.json")), ids=lambda p: p.name)
def test_each_committed_quantized_tile_file_is_named_by_its_meta_and_every_entry_parses(
        path: Path) -> None:
    """A committed file the lookup would skip (a name its meta does not give, an entry a format
    rule refuses) would silently leave its shape on the in-code defaults."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    name = quant_config_file_name(meta["format"], meta["E"], meta["H"], meta["I"], meta["top_k"],
                                  meta["group"], getattr(torch, meta["dtype"]),
                                  meta["device_name"], meta["triton"],
                                  layout=meta.get("weight_layout", "rows"))
    assert path.name == name
    assert data["configs"], "a committed file with no finished entry"
    for tokens, raw in data["configs"].items():
        entry = quant_configs.parse_quant_entry(raw, meta["format"], meta["group"])
        assert int(tokens) > 0 and entry["ms"] > 0


# ------------------------------------------------ the FP8 Gluon kernel's candidates

def test_fp8_candidates_the_gluon_kernel_runs_alike_are_timed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where both launches run fp8_gluon's kernel (sm90, its shape rules), it reads only the
    row-block height: of the 64- and 128-row candidates the first of each is timed, the
    16- and 32-row ones (Triton's tiles) all, the default first."""
    from types import SimpleNamespace

    from moeserve.kernels.moe.quant import fp8_gluon

    num_tokens = 256  # 128 pairs an expert: 64- and 128-row blocks in the grid
    grid = quant_tune_candidates("fp8", E, K, num_tokens, 128)
    assert sum(c["BLOCK_M"] == 64 for c in grid) > 1 and sum(
        c["BLOCK_M"] == 128 for c in grid) > 1
    distinct = fp8_gluon.distinct_candidates(grid)
    assert distinct[0] == grid[0]
    assert [c["BLOCK_M"] for c in distinct if c["BLOCK_M"] >= 64] == sorted(
        {64, 128}, key=[c["BLOCK_M"] for c in grid].index)
    assert [c for c in distinct if c["BLOCK_M"] < 64] == [c for c in grid if c["BLOCK_M"] < 64]
    monkeypatch.setattr(fp8_gluon, "backend", "gluon-128")  # every op's blocks 128 high
    assert fp8_gluon.distinct_candidates(grid) == grid[:1]
    monkeypatch.setattr(fp8_gluon, "backend", "gluon")

    # the tuner times the distinct ones only where takes_every_launch holds
    experts = SimpleNamespace(scale_rows=128, qweight=SimpleNamespace(device=torch.device("cpu")))
    seen = []
    monkeypatch.setattr(fp8_gluon, "takes_every_launch",
                        lambda h, i, rows, device: seen.append((h, i, rows)) or True)
    calls, timer = fake_timer()
    tune("fp8", tmp_path / "g.json", [num_tokens], timer, weights=(experts, experts))
    assert seen == [(H, N, 128)]
    assert [key for key, _ in calls] == [config_key(c) for c in distinct]
    monkeypatch.setattr(fp8_gluon, "takes_every_launch", lambda *a: False)
    calls, timer = fake_timer()
    tune("fp8", tmp_path / "t.json", [num_tokens], timer, weights=(experts, experts))
    assert len(calls) == len(grid)


def test_the_gluon_kernel_takes_every_launch_only_on_sm90_at_its_shapes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """sm90 (the capability faked here), 128-row weight scales, H and I whole and even
    counts of 128-steps, and a switch value that hands it both launches."""
    from moeserve.kernels.moe.quant import fp8_gluon

    cuda = torch.device("cuda")
    assert not fp8_gluon.takes_every_launch(2048, 768, 128, torch.device("cpu"))
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[0])
    monkeypatch.setattr(fp8_gluon, "backend", "gluon")
    assert fp8_gluon.takes_every_launch(2048, 768, 128, cuda)  # qwen3-30b-a3b's experts
    assert fp8_gluon.takes_every_launch(6144, 2048, 128, cuda)  # GLM-5's
    assert not fp8_gluon.takes_every_launch(2048, 1408, 128, cuda)  # 11 steps: odd
    assert not fp8_gluon.takes_every_launch(2048, 700, 128, cuda)  # not whole steps
    assert not fp8_gluon.takes_every_launch(2048, 768, 1, cuda)  # a scale a row
    for other in ("triton", "gluon-down"):  # Triton runs a launch
        monkeypatch.setattr(fp8_gluon, "backend", other)
        assert not fp8_gluon.takes_every_launch(2048, 768, 128, cuda)
    monkeypatch.setattr(fp8_gluon, "backend", "gluon-ws")
    assert fp8_gluon.takes_every_launch(2048, 768, 128, cuda)
    capability[0] = (10, 0)
    assert not fp8_gluon.takes_every_launch(2048, 768, 128, cuda)
