"""`moeserve bench --diagnose` against the bench's test server (tests/bench/fake_server.py):
the engine timeline, the run clock, the expert-load delta, verdicts in the JSON line.

The samplers stamp a fake clock the test moves, and the test waits for the samples it needs
rather than sleeping and counting them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from moeserve.bench.cli import run_bench
from moeserve.bench.diagnostics import RunDiagnostics, attach
from tests.bench.fake_server import FakeServer
from tests.diagnose.test_telemetry import FakeNvml
from tests.wait import wait_until


def _engine_doc(steps: int, running: int, load_scale: int) -> dict:
    # a CUDA engine: tokens per expert is a GPU verdict (on CPU torch's threads matter instead)
    return {"capacity_report": {"engine_config": {"device": "cuda", "max_model_len": 4096},
                                "model": "fake", "vocab_size": 1000, "max_running_requests": 8},
            "stats": {"num_running": running, "num_waiting": 0, "kv_usage": 0.25,
                      "num_steps": steps, "num_preemptions": 0, "step_seconds": 0.01,
                      "expert_load": {"num_steps": steps,
                                      "tokens_per_expert": [[load_scale, 2 * load_scale]]}}}


def test_run_diagnostics_timeline_clock_and_expert_load() -> None:
    clock = SimpleNamespace(now=100.0)
    with FakeServer() as server:
        server.state.options.engine = _engine_doc(100, 0, 10)
        diag = RunDiagnostics(server.url, None, True, None, nvml=FakeNvml(),
                              engine_interval_s=0.01, gpu_interval_s=0.01,
                              clock=lambda: clock.now)
        diag.start()  # at 100.0
        wait_until(lambda: diag.timeline.rows and len(diag.gpu.t) >= 2, "first samples")
        clock.now = 100.3
        server.state.options.engine = _engine_doc(160, 4, 40)
        wait_until(lambda: diag.timeline.rows[-1]["num_running"] == 4, "a sample of the change")
        clock.now = 100.6
        d = diag.stop(duration=0.5)
    tl = d["engine_timeline"]
    assert tl["available"] and tl["errors"] == 0 and tl["t"] == sorted(tl["t"])
    # t = 0 is the run's start: the run was the last 0.5 s of the 0.6 s of sampling; the last
    # sample is the end-of-run one, at stop()
    assert tl["t"][0] == -0.1 and tl["t"][-1] == 0.5
    assert d["clock"]["slack_s"] == 0.1
    assert set(tl["stats"]) == {"num_running", "num_waiting", "kv_usage", "num_steps",
                                "num_preemptions", "step_seconds"}
    running = tl["stats"]["num_running"]
    assert running[0] == 0 and running[-1] == 4 and 4 in running[:-1]  # sampled during the run
    assert d["expert_load"] == {"num_steps": 60, "tokens_per_expert": [[30, 60]]}
    gpu = d["gpu"]
    assert gpu["available"] and len(gpu["t"]) >= 2 and len(gpu["devices"]) == 2
    assert gpu["t"][0] == -0.1 and gpu["t"] == sorted(gpu["t"])
    assert len(gpu["devices"][0]["power_w"]) == len(gpu["t"])
    assert d["cpu"]["available"] is False and "--url" in d["cpu"]["reason"]
    assert d["sampler_errors"] == {}
    res = {"duration": 0.5, "max_concurrency": 4, "num_prompts": 12, "client": [],
           "engine": server.state.options.engine}
    verdicts = attach(res, d)
    assert res["diagnostics"] is d and res["verdicts"] == [v.to_dict() for v in verdicts]
    # 90 routed tokens / (1 layer x 2 experts x 60 steps): far too few per expert; the fake
    # GPUs (250 of 700 W at 40%) fire gpu_power when their samples fall inside the run
    fired = {v.rule: v for v in verdicts}
    assert "tokens_per_expert" in fired and set(fired) <= {"tokens_per_expert", "gpu_power"}
    assert fired["tokens_per_expert"].evidence["mean_tokens_per_expert_per_step"] == 0.75


def test_server_without_engine_route_gets_no_timeline() -> None:
    diag = RunDiagnostics("http://127.0.0.1:9", None, False, None, nvml=FakeNvml(fail_init=True))
    diag.start()
    d = diag.stop(duration=None)
    assert d["engine_timeline"]["available"] is False
    assert d["engine_timeline"]["reason"] == "the server has no /v1/engine"
    assert d["gpu"]["available"] is False and d["expert_load"] is None


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


def test_bench_diagnose_flag_writes_diagnostics_and_verdicts(
        fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture,
        first_sample_before_the_run: None) -> None:
    fake_server.state.options.delay_s = 0.02
    fake_server.state.options.engine = _engine_doc(10, 2, 1000)
    out = tmp_path / "runs.jsonl"
    rc = run_bench(["--url", fake_server.url, "--max-concurrency", "2,4", "--input-len", "8",
                    "--output-len", "10", "--output-json", str(out), "--no-warmup",
                    "--no-progress", "--diagnose"])
    assert rc == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(runs) == 2
    for r in runs:
        assert isinstance(r["verdicts"], list)
        tl = r["diagnostics"]["engine_timeline"]
        # the sample from before the run (the fixture waits for it) and the end-of-run one
        assert tl["available"] and len(tl["t"]) >= 2 and tl["stats"]["num_running"][0] == 2
        assert r["diagnostics"]["cpu"]["available"] is False
    text = capsys.readouterr().out
    assert text.count("Doctor") == 2 and "no cpu samples" in text
    # without the flag: no diagnostics, no verdicts
    out2 = tmp_path / "plain.jsonl"
    assert run_bench(["--url", fake_server.url, "--max-concurrency", "2", "--input-len", "8",
                      "--output-len", "4", "--output-json", str(out2), "--no-warmup",
                      "--no-progress"]) == 0
    plain = json.loads(out2.read_text())
    assert "diagnostics" not in plain and "verdicts" not in plain


def test_a_failing_doctor_keeps_the_run() -> None:
    res = {"duration": 1.0, "warnings": []}
    bad = {"engine_timeline": {"t": [0.0, 0.5], "stats": {"num_running": [1]}}}
    assert attach(res, bad) == []
    assert res["verdicts"] == [] and res["diagnostics"] is bad
    assert res["warnings"] == ["the doctor failed: ValueError: diagnostics.engine_timeline.stats."
                               "num_running has 1 values for 2 times"]
