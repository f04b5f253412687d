"""The MoE tile source is an engine knob (moe_tiles, `--moe-tiles tuned|default`): "default"
leaves tuned tile files and the start-up tune out, and the capacity report says so (issue 13:
"the MoE autotune left out" must be expressible; a zero tune budget still loads tuned files)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moeserve import LLM
from moeserve.cli import build_parser
from moeserve.config import ConfigError, EngineConfig
from moeserve.engine.args import engine_config_from_kwargs, engine_kwargs_from_args
from moeserve.engine.core import EngineCore
from moeserve.kernels.moe import tile_configs as moe_configs
from moeserve.kernels.moe import tune as moe_tune


def test_moe_tiles_is_validated() -> None:
    assert EngineConfig().moe_tiles == "tuned"
    assert EngineConfig(moe_tiles="default").moe_tiles == "default"
    with pytest.raises(ConfigError, match=r"moe_tiles must be one of tuned, default; got 'x'"):
        EngineConfig(moe_tiles="x")


def test_the_flag_is_listed_and_parses(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--moe-tiles MOE_TILES" in help_text and "no start-up tune" in help_text
    args = build_parser().parse_args(["serve", "--preset", "tiny-moe", "--moe-tiles", "default"])
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["moe_tiles"] == "default"
    assert engine_config_from_kwargs(**kwargs).moe_tiles == "default"
    args = build_parser().parse_args(["serve", "--moe-tiles", "x"])  # refused by the config
    with pytest.raises(ConfigError, match="moe_tiles"):
        engine_config_from_kwargs(**engine_kwargs_from_args(args))


def fake_core(moe_tiles: str, **cfg: object) -> SimpleNamespace:
    """What `EngineCore._ensure_moe_tuned` reads: the config, the MoE shape, the dtype."""
    mc = SimpleNamespace(num_experts=8, hidden_size=32, moe_intermediate_size=16,
                         num_experts_per_tok=2)
    return SimpleNamespace(cfg=EngineConfig(moe_backend="measured", moe_tiles=moe_tiles, **cfg),
                           model_config=mc,
                           runner=SimpleNamespace(dtype=torch.float16,  # bf16-style experts
                                                  model=SimpleNamespace(moe_blocks=lambda: [])),
                           _moe_shape=lambda: (8, 32, 16))  # the rank's (experts, hidden, width)


def test_default_tiles_skip_the_start_up_tune(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    name = moe_configs.config_file_name(8, 32, 16, torch.float16, "Fake GPU")
    doc = {"meta": {}, "configs": {"1": moe_configs.tile_config(16, 16, 16, 1, 4, 2)}}
    (tmp_path / name).write_text(json.dumps(doc))
    monkeypatch.setattr("moeserve.engine.core.tile_device_name", lambda device: "Fake GPU")

    def no_tune(*args: object, **kwargs: object) -> None:
        raise AssertionError("moe_tiles=default tunes nothing")

    monkeypatch.setattr(moe_tune, "ensure_tuned", no_tune)
    moe_configs.clear_caches()
    try:
        cuda = torch.device("cuda")  # a descriptor only: nothing runs on it
        line = EngineCore._ensure_moe_tuned(fake_core("default"), cuda)
        assert line.startswith("not tuned: moe_tiles=default")
        # a zero budget alone still takes the tuned file: what moe_tiles=default is for
        line = EngineCore._ensure_moe_tuned(fake_core("tuned", moe_tune_budget_s=0), cuda)
        assert line == f"not tuned at start-up (moe_tune_budget_s=0): using {tmp_path / name}"
    finally:
        moe_configs.clear_caches()


def test_an_engine_with_default_tiles_reports_them() -> None:
    llm = LLM("tiny-moe", device="cpu", max_model_len=64, moe_backend="triton",
              moe_tiles="default")
    report = llm.report
    assert report.engine_config.moe_tiles == "default"
    assert report.moe_tune.startswith("not tuned: moe_tiles=default")
    assert all(not c["tuned"] and c["source"] == "default" and c["backend"] == "triton"
               for c in report.moe_configs.values())
    lines = report.format().splitlines()
    assert any(line.split()[:3] == ["MoE", "tile", "configs"]
               and "default tiles (moe_tiles=default): default" in line for line in lines)
    assert any(line.split()[:2] == ["MoE", "tune"] and "moe_tiles=default" in line
               for line in lines)
    backend = llm.engine.runner.model.moe_blocks()[0].backend  # bound at construction
    assert backend.keywords == {"tiles": "default"}


def test_the_report_and_the_kernels_look_tuned_tiles_up_under_one_device_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # on CPU the engine named the device by its processor for the report's lookup, the kernels
    # by "cpu": a file one found the other missed; both use tile_device_name now
    monkeypatch.setenv(moe_configs.CONFIG_DIR_ENV, str(tmp_path))
    assert moe_configs.tile_device_name(torch.device("cpu")) == "cpu"
    name = moe_configs.config_file_name(16, 128, 64, torch.float32, "cpu")
    doc = {"meta": {}, "configs": {"1": moe_configs.tile_config(16, 32, 32, 1, 4, 2)}}
    (tmp_path / name).write_text(json.dumps(doc))
    moe_configs.clear_caches()
    try:
        llm = LLM("tiny-moe", device="cpu", max_model_len=64, moe_backend="triton")
        assert all(c["tuned"] and c["source"] == str(tmp_path / name)
                   for c in llm.report.moe_configs.values())
    finally:
        moe_configs.clear_caches()
