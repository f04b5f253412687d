"""End to end: `moeserve bench --diagnose` starts a real `moeserve serve` (tiny-moe on CPU), then
`moeserve doctor` and `moeserve report` read the JSON line it wrote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from moeserve.bench.cli import run_bench
from moeserve.diagnose.cli import add_report_args, run_report


def test_bench_diagnose_against_its_own_server(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run.jsonl"
    rc = run_bench(["--server-args", "--device cpu --max-model-len 512", "--max-concurrency",
                    "4", "--num-prompts", "12", "--input-len", "16", "--output-len", "48",
                    "--output-json", str(out), "--no-progress", "--diagnose"])
    assert rc == 0
    (run,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["completed"] == 12 and isinstance(run["verdicts"], list)
    diag = run["diagnostics"]
    tl = diag["engine_timeline"]
    assert tl["available"] and len(tl["t"]) >= 2 and tl["errors"] == 0
    steps = tl["stats"]["num_steps"]
    assert steps[-1] > steps[0]  # the engine stepped during the run
    assert max(tl["stats"]["num_running"]) >= 1
    # most of the run's tokens fall between the first and the last sample (the first can come
    # a few steps late on a loaded machine)
    assert tl["stats"]["num_generated_tokens"][-1] - tl["stats"]["num_generated_tokens"][0] \
        >= 12 * 48 // 2
    roles = sorted(p["role"] for p in diag["cpu"]["processes"])
    assert roles == ["api", "engine"] and len(diag["cpu"]["t"]) >= 2
    engine = next(p for p in diag["cpu"]["processes"] if p["role"] == "engine")
    assert max(f for f in engine["cpu_fraction"] if f is not None) > 0.1
    # the engine's expert counters over the run: tiny-moe routes top-2 of 16 experts
    load = diag["expert_load"]
    assert load is not None and load["num_steps"] > 0 and len(load["tokens_per_expert"][0]) == 16
    assert diag["gpu"]["available"] is False and diag["gpu"]["reason"]
    # the engine's share of the run: every generated token of the run, and the loop's times
    er = run["engine_run"]
    assert er["counters"]["num_generated_tokens"] >= 12 * 48 - 12  # first tokens: prefill
    assert er["counters"]["num_steps"] >= 48 and er["counters"]["num_graph_steps"] == 0
    assert er["counters"]["num_forward_steps"] == er["counters"]["num_steps"]
    assert 0 < er["mean_step_ms"] <= er["mean_loop_ms"] and 0 < er["busy_share"] <= 1.0
    text = capsys.readouterr().out
    assert "engine: " in text and "a busy loop iteration" in text
    assert "Doctor" in text and "no gpu samples" in text
    parser = argparse.ArgumentParser()
    add_report_args(parser)
    assert run_report(parser.parse_args([str(out), "--out", str(tmp_path / "rep")])) == 0
    assert {p.name for p in (tmp_path / "rep").iterdir()} == {
        "report.md", "throughput_tpot.png", "timeline_1.png", "experts_1.png"}
