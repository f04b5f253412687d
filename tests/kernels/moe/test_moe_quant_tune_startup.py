"""The quantized fused MoE's tune at start-up (kernels/moe/quant/tune.py's
`ensure_quant_tuned`, engine/moe_setup.py): it tunes once and returns at once after, keeps a
committed file, needs CUDA; the engine's start-up line and capacity report name the tiles; the
command line tunes one format and shape. Fake timers stand in for the CUDA ones
(test_moe_quant_tune.py's)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.engine import moe_setup
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe.quant import tune as quant_tune
from moeserve.kernels.moe.quant.configs import get_quant_config, quant_config_file_name
from moeserve.kernels.moe.quant.tune import ensure_quant_tuned
from moeserve.kernels.moe.tile_configs import config_key, tile_config
from moeserve.runner.capacity import CapacityReport
from moeserve.runner.kv_cache import MemoryPlan
from tests.kernels.moe.test_moe_quant_tune import (
    GROUPS,
    SMALL,
    E,
    H,
    K,
    N,
    fake_timer,
    write_tuned,
)

pytestmark = pytest.mark.usefixtures("isolated_config_dirs")  # conftest.py



def test_ensure_quant_tuned_tunes_once_then_returns_at_once(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(moe_configs.CONFIG_DIR_ENV)  # tunes go to the user cache
    calls, timer = fake_timer()
    args = ("int4", E, H, N, K, 32, torch.float32, 4)  # engine counts 1, 2, 4
    outcome = ensure_quant_tuned(*args, timer=timer, device_name="Fake GPU", log=lambda s: None)
    expected = (isolated_config_dirs / "cache" / "moe_configs"
                / quant_config_file_name("int4", E, H, N, K, 32, torch.float32, "Fake GPU"))
    assert outcome.tuned and outcome.source == str(expected) and expected.exists()
    assert outcome.detail.startswith("tuned now: 3 of 3 token counts")
    assert {n for _, n in calls} == {1, 2, 4}
    assert get_quant_config(*args[:7], 2, "Fake GPU").tuned
    calls.clear()
    again = ensure_quant_tuned(*args, timer=timer, device_name="Fake GPU", log=lambda s: None)
    assert calls == [] and again.detail == "tuned earlier (cached)"
    calls.clear()  # a larger engine: resumes the same file with the new counts only
    more = ensure_quant_tuned(*args[:7], 16, timer=timer, device_name="Fake GPU",
                              log=lambda s: None)
    assert {n for _, n in calls} == {8, 16} and more.source == str(expected)
    spent = ensure_quant_tuned(*args[:7], 64, time_budget_s=0, timer=timer,
                               device_name="Fake GPU", log=lambda s: None)
    assert "time budget spent" in spent.detail and spent.tuned


def test_ensure_quant_tuned_uses_a_committed_file_and_needs_cuda(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tuned(isolated_config_dirs / "package", "fp8",
                       {64: tile_config(16, 64, 128, 1, 4, 3)}, device="Fake GPU")
    outcome = ensure_quant_tuned("fp8", E, H, N, K, 128, torch.float32, 8192,
                                 timer=lambda c, n: pytest.fail("a committed file is kept"),
                                 device_name="Fake GPU", log=lambda s: None)
    assert outcome.tuned and outcome.source == str(path) and outcome.detail == "committed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    outcome = ensure_quant_tuned("fp8", E, H, N, K, 128, torch.float32, 8192)
    assert not outcome.tuned and outcome.source == "default" and "no CUDA" in outcome.detail


def quant_block(fmt: str) -> SimpleNamespace:
    """What the engine reads of a quantized MoE block: its weights' format, group and shape."""
    group = GROUPS[fmt]
    return SimpleNamespace(num_local_experts=E,
                           w13=SimpleNamespace(format=fmt, group=group, shape=(E, 2 * N, H)),
                           w2=SimpleNamespace(format=fmt, group=group, shape=(E, H, N)))


def test_the_engine_tunes_quantized_experts_at_start_up(
        isolated_config_dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mc = SimpleNamespace(hidden_size=H, num_experts_per_tok=K, num_experts=E)
    cuda = torch.device("cuda")  # a descriptor only: nothing runs on it
    monkeypatch.setattr(moe_setup, "tile_device_name", lambda device: "cpu")
    seen: list[tuple] = []

    def fake_ensure(*args: object, **kwargs: object) -> quant_tune.TuneOutcome:
        seen.append(args)
        return quant_tune.TuneOutcome(1.5, True, "/x.json", "tuned now: 3 of 3 token counts")

    monkeypatch.setattr(quant_tune, "ensure_quant_tuned", fake_ensure)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    line = moe_setup.ensure_quant_moe_tuned(EngineConfig(moe_tiles="default"), mc,
                                             quant_block("fp8"), torch.float32, cuda)
    assert line.startswith("not tuned: moe_tiles=default (fp8 experts") and seen == []
    path = write_tuned(isolated_config_dirs / "env", "fp8", {1: tile_config(16, 64, 128, 1, 4, 3)})
    line = moe_setup.ensure_quant_moe_tuned(EngineConfig(moe_tune_budget_s=0), mc,
                                        quant_block("fp8"), torch.float32, cuda)
    assert line == f"not tuned at start-up (moe_tune_budget_s=0; fp8 experts): using {path}"
    assert seen == []
    assert moe_setup.ensure_quant_moe_tuned(EngineConfig(), mc, quant_block("fp8"), torch.float32,
                                        torch.device("cpu")) == ""  # the reference: no tiles
    line = moe_setup.ensure_quant_moe_tuned(EngineConfig(moe_tune_budget_s=30), mc,
                                        quant_block("int4"), torch.float32, cuda)
    assert line == "int4 experts: tuned now: 3 of 3 token counts (/x.json, 1.5s)"
    assert seen == [("int4", E, H, N, K, 32, torch.float32, 8192)]


def test_the_report_names_the_quantized_tiles(isolated_config_dirs: Path) -> None:
    mc = SimpleNamespace(hidden_size=H, num_experts_per_tok=K, num_experts=E)  # every expert here
    entry = {**SMALL, "ms": 0.1}
    path = write_tuned(isolated_config_dirs / "env", "nvfp4", {64: entry})
    tuned = moe_setup.quant_moe_configs(EngineConfig(), mc, quant_block("nvfp4"), torch.float32,
                                    "cpu")
    assert all(c["tuned"] and c["source"] == str(path) and c["tiles"] == config_key(SMALL)
               and c["format"] == "nvfp4" and c["backend"] == "triton" for c in tuned.values())
    default = moe_setup.quant_moe_configs(EngineConfig(moe_tiles="default"), mc,
                                      quant_block("nvfp4"), torch.float32, "cpu")
    assert all(not c["tuned"] and c["source"] == "default" for c in default.values())
    plan = MemoryPlan("cuda", 0, 0, 0, 0, 0, 0, 1, 2, 16, "test")
    report = CapacityReport("m", "a", 1, 1, "Fake GPU", EngineConfig(), plan, 1, "test", {},
                            moe_configs=tuned)
    line, = (ln for ln in report.format().splitlines() if "MoE tile configs" in ln)
    assert line.endswith(f"  tuned (nvfp4 experts, the fused quantized MoE): {path}")


def test_the_command_line_tunes_one_format_and_shape(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(quant_tune, "tune_quant_moe",
                        lambda *args, **kwargs: seen.append((args, kwargs)))
    quant_tune.main(["--format", "int4", "-E", "256", "-H", "6144", "-I", "2048", "-k", "8",
                     "--group", "32", "--out", str(tmp_path), "--max-batched-tokens", "4"])
    (args, kwargs), = seen
    assert args[:7] == ("int4", 256, 6144, 2048, 8, 32, torch.bfloat16)
    assert args[7] == [1, 2, 4] and kwargs == {"time_budget_s": None}
    # GLM-5's K dims fit micro-tiles: the tune times them so and its file says so
    assert args[8] == tmp_path / quant_config_file_name("int4", 256, 6144, 2048, 8, 32,
                                                        torch.bfloat16, "Fake GPU",
                                                        layout="micro")
    assert ",layout=micro," in args[8].name
    quant_tune.main(["--format", "nvfp4", "-E", "8", "-H", "256", "-I", "128", "-k", "2",
                     "--out", str(tmp_path), "--tokens", "64", "1024"])
    assert seen[1][0][:6] == ("nvfp4", 8, 256, 128, 2, 16) and seen[1][0][7] == [64, 1024]
    assert ",layout=micro," in seen[1][0][8].name  # K 256 and 128: micro-tiles fit too
    with pytest.raises(SystemExit):
        quant_tune.main(["--format", "fp8", "-E", "8", "-H", "256", "-I", "128", "-k", "2",
                         "--out", str(tmp_path), "--tokens", "0"])


def test_quantized_blocks_follow_the_tile_source_bound_into_the_backend() -> None:
    from moeserve.kernels.registry import get_moe_backend, moe_tile_source

    assert moe_tile_source(get_moe_backend("triton", "default")) == "default"
    assert moe_tile_source(get_moe_backend("measured", "tuned")) == "tuned"
    assert moe_tile_source(get_moe_backend("torch", "default")) == "tuned"  # no tiles bound
