"""End to end: `moeserve bench --diagnose` starts a real `moeserve serve` (tiny-moe on CPU), then
`moeserve doctor` and `moeserve report` read the JSON line it wrote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from moeserve.bench.cli import run_bench
from moeserve.diagnose.cli import add_report_args, run_report


def test_bench_diagnose_against_its_own_server(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               first_sample_before_the_run: None) -> None:
    out = tmp_path / "run.jsonl"
    rc = run_bench(["--server-args", "--device cpu --max-model-len 512", "--max-concurrency",
                    "4", "--num-prompts", "12", "--input-len", "16", "--output-len", "48",
                    "--output-json", str(out), "--no-progress", "--diagnose"])
    assert rc == 0
    (run,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert run["completed"] == 12 and isinstance(run["verdicts"], list)
    diag = run["diagnostics"]
    # the timeline holds a sample from before the run (the fixture waits for it) and the
    # end-of-run one: every token of the run falls between the two
    tl = diag["engine_timeline"]
    assert tl["available"] and len(tl["t"]) >= 2 and tl["errors"] == 0
    assert tl["t"] == sorted(tl["t"]) and tl["t"][0] <= 0 < tl["t"][-1]
    steps = tl["stats"]["num_steps"]
    assert steps[-1] - steps[0] >= 48  # the engine stepped during the run
    assert tl["stats"]["num_generated_tokens"][-1] - tl["stats"]["num_generated_tokens"][0] \
        >= 12 * 48 - 12  # first tokens: prefill
    # the server's processes by role; how many CPU samples fall in the run is the machine's
    # business, but each is a number for each live process
    cpu = diag["cpu"]
    assert cpu["available"] and sorted(p["role"] for p in cpu["processes"]) == ["api", "engine"]
    for proc in cpu["processes"]:
        assert len(proc["cpu_fraction"]) == len(cpu["t"])
        assert all(f is not None and f >= 0 for f in proc["cpu_fraction"])
    assert diag["sampler_errors"] == {}
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
