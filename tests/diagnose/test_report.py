"""`moeserve report` and `moeserve doctor` over synthetic JSON lines: files, PNGs, config diff."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib.image
import pytest

from moeserve.diagnose.cli import add_doctor_args, add_report_args, run_doctor, run_report
from moeserve.diagnose.report import config_diff, flatten, load_runs, resolved_config
from tests.diagnose.synthetic import make_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, runs: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    return str(path)


def _args(add: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert img[..., :3].std() > 0.01  # something is drawn on it


def test_config_diff_names_exactly_the_knobs_that_differ() -> None:
    a = make_run(diagnose=False)
    b = make_run(diagnose=False, cache__mem_fraction=0.8, scheduler__max_num_batched_tokens=16384)
    assert config_diff([a, b]) == {"cache.mem_fraction": [0.9, 0.8],
                                   "scheduler.max_num_batched_tokens": [8192, 16384]}
    assert config_diff([a, a]) == {}
    # what "auto" resolved to counts, and a key one run lacks shows as missing
    c = make_run(diagnose=False, cap=64, cap_setting=64)
    del c["engine"]["capacity_report"]["engine_config"]["seed"]
    diff = config_diff([a, c])
    assert diff == {"scheduler.max_running_requests": ["auto", 64],
                    "resolved.max_running_requests": [1935, 64], "seed": [0, "—"]}
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": [1, 2],
                                                                  "d": None}
    assert resolved_config(a)["resolved.kv_tokens"] == 495488


def test_report_two_runs_files_plots_and_diff(tmp_path: Path) -> None:
    capped = make_run(cap=64, cap_setting=64, running=64, waiting=960, expert_tpe=4.0, step_ms=20)
    auto = make_run()
    sweep = [make_run(conc=c, running=c, diagnose=False) for c in (256, 512)]
    f1 = _write(tmp_path / "w1-cap64.jsonl", [capped])
    f2 = _write(tmp_path / "w1-auto.jsonl", [auto] + sweep)
    out = tmp_path / "report"
    assert run_report(_args(add_report_args, [f1, f2, "--out", str(out)])) == 0
    md = (out / "report.md").read_text()
    names = sorted(p.name for p in out.iterdir())
    assert names == ["experts_1.png", "experts_2.png", "report.md", "throughput_tpot.png",
                     "timeline_1.png", "timeline_2.png"]
    for png in out.glob("*.png"):
        _assert_png(png)
        assert f"]({png.name})" in md  # every plot is linked from the markdown
    assert "## Side by side" in md and "## Config diff" in md
    diff_rows = md.split("## Config diff")[1].split("## Run 1")[0]
    assert "| scheduler.max_running_requests | 64 | auto | auto | auto |" in diff_rows
    assert "| resolved.max_running_requests | 64 | 1935 | 1935 | 1935 |" in diff_rows
    assert diff_rows.count("\n| ") == 3  # header + two keys
    assert "**admission_cap** (critical)" in md.split("## Run 2")[0]
    assert "admission_cap" not in md.split("## Run 2")[1]


def test_report_one_run_has_no_side_by_side(tmp_path: Path) -> None:
    f = _write(tmp_path / "one.jsonl", [make_run(expert_tpe=None)])
    out = tmp_path / "r"
    assert run_report(_args(add_report_args, [f, "--out", str(out)])) == 0
    md = (out / "report.md").read_text()
    assert "Side by side" not in md and "Config diff" not in md
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "throughput_tpot.png",
                                                     "timeline_1.png"]


def test_bad_inputs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(make_run(diagnose=False)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_runs([str(bad)])
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match=r"other.jsonl:1: not a bench result"):
        load_runs([str(other)])
    assert run_report(_args(add_report_args, [str(tmp_path / "nope.jsonl"), "--out",
                                              str(tmp_path / "o")])) == 2
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    assert run_doctor(_args(add_doctor_args, [str(bad)])) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_doctor_cli_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = _write(tmp_path / "runs.jsonl", [make_run(preemptions=4), make_run()])
    assert run_doctor(_args(add_doctor_args, [f])) == 0
    text = capsys.readouterr().out
    first, second = text.split("== runs.jsonl:2")
    assert "== runs.jsonl:1" in first and "[warning] kv_capacity" in first
    assert "knob: --mem-fraction" in first and "no verdict: no rule fired" in second
    assert run_doctor(_args(add_doctor_args, [f, "--json"])) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["run"] for x in lines] == ["runs.jsonl:1", "runs.jsonl:2"]
    assert [v["rule"] for v in lines[0]["verdicts"]] == ["kv_capacity"]
    assert lines[0]["verdicts"][0]["evidence"]["preemptions"] == 4 and lines[1]["verdicts"] == []
