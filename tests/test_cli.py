"""The command line: presets listing, offline generate on tiny-moe, errors as messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.cli import main


def test_presets_lists_shapes(capsys: pytest.CaptureFixture) -> None:
    from moeserve.presets import list_presets

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "tiny-moe" in out and "qwen3-30b-a3b" in out and "mixtral-8x7b" in out
    assert "30.532B" in out  # Qwen3-30B-A3B's parameter count, from its shape alone
    assert "671.026B" in out and "1026.408B" in out  # DeepSeek-V3, Kimi K2
    header, *rows = out.splitlines()
    assert [row.split()[0] for row in rows] == list_presets()
    # the columns line up, whatever the longest name: each row's arch starts under "arch"
    column = header.index("arch")
    assert all(row[column - 2:column] == "  " and row[column] != " " for row in rows)


def test_generate_tiny_moe(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_file = tmp_path / "gen.json"
    rc = main(["generate", "--preset", "tiny-moe", "--device", "cpu", "--num-prompts", "3",
               "--max-tokens", "5", "--ignore-eos", "--max-running-requests", "2",
               "--json-out", str(out_file)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "moeserve capacity report" in text and "max running requests" in text
    result = json.loads(out_file.read_text())
    assert result["summary"]["output_tokens"] == 15
    assert result["capacity"]["max_running_requests"] == 2
    assert result["capacity"]["kv_tokens"] > 0


def test_capacity_report_records_the_moeserve_variables_set(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A result's provenance: the MOESERVE_ switches set in the engine's process (and only
    those), in the report's dict and its text."""
    from moeserve import LLM, envs

    for name in envs.set_variables():
        monkeypatch.delenv(name)
    monkeypatch.setenv(envs.MLA_DECODE_SWAPPED, "0")
    monkeypatch.setenv(envs.GROUPED_ROUTER_TRITON, "0")
    monkeypatch.setenv("MOESERVE_NOT_A_SWITCH", "x")  # not one of envs.py's: not recorded
    report = LLM("tiny-moe", device="cpu").report
    assert report.to_dict()["environment"] == {envs.GROUPED_ROUTER_TRITON: "0",
                                               envs.MLA_DECODE_SWAPPED: "0"}
    line = next(line for line in report.format().splitlines()
                if line.split()[:1] == ["environment"])
    assert "MOESERVE_MLA_DECODE_SWAPPED=0" in line


def test_generate_bad_flag_value(capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", "--preset", "tiny-moe", "--device", "cpu", "--block-size", "12"])
    assert rc == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_capacity_report_names_the_moe_tile_configs() -> None:
    from moeserve import LLM

    report = LLM("tiny-moe", device="cpu", moe_backend="triton").report
    configs = report.to_dict()["moe_configs"]
    assert set(configs) == {"1", "64", "256", "1024", "8192"}
    assert all(not c["tuned"] and c["source"] == "default" for c in configs.values())
    assert any(line.split()[:3] == ["MoE", "tile", "configs"] and "NOT tuned (defaults)" in line
               for line in report.format().splitlines())
    tiles_line = next(line for line in report.format().splitlines()
                      if line.split()[:4] == ["MoE", "tiles", "by", "tokens"])
    assert f"1: {configs['1']['tiles']}" in tiles_line and "+down" not in tiles_line
    assert LLM("tiny-moe", device="cpu", moe_backend="grouped_mm").report.moe_configs == {}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_renders_every_engine_flag(command: str, capsys: pytest.CaptureFixture) -> None:
    """argparse %-formats each help text: a config docstring with "13%" broke --help."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--moe-weight-layout" in out and "13% (NVFP4)" in out
