"""`run_bench` driven by argv lists against the test server: sweeps, JSON lines, errors."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

from moeserve.bench import server as server_mod
from moeserve.bench.cli import add_bench_args, run_bench, run_bench_argv
from moeserve.bench.records import RequestRecord
from moeserve.bench.server import (
    ServerProcess,
    find_key,
    first_model,
    get_json,
    git_commit,
    vocab_size_of,
)
from tests.bench.fake_server import FakeServer


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sweep_writes_one_json_line_per_run(fake_server: FakeServer, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    fake_server.state.options.chunk_sizes = [2, 1]
    out = tmp_path / "bench.jsonl"
    rc = run_bench(["--url", fake_server.url, "--max-concurrency", "2,4", "--input-len", "16",
                    "--output-len", "5", "--output-json", str(out), "--no-warmup",
                    "--no-progress"])
    assert rc == 0
    runs = _lines(out)
    assert [r["max_concurrency"] for r in runs] == [2, 4]
    assert [r["num_prompts"] for r in runs] == [6, 12]  # 3 x the concurrency
    for r in runs:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0
        assert r["total_output_tokens"] == 5 * r["num_prompts"] == r["total_streamed_tokens"]
        assert r["usage_mismatches"] == 0 and r["total_input_tokens"] == 16 * r["num_prompts"]
        assert r["request_rate"] == "inf" and r["output_throughput"] > 0
        assert r["server"]["model"] == "fake-model" and r["device"] == "cpu"
        assert r["engine"]["capacity_report"]["vocab_size"] == 1000
        assert r["git_commit"] == git_commit()["commit"]
        assert r["config"]["input_len"] == 16 and "api_key" not in r["config"]
        recs = [RequestRecord.from_dict(d) for d in r["requests"]]
        assert all(rec.chunk_tokens == [2, 1, 2] for rec in recs)
        for key in ("mean_ttft_ms", "p99_tpot_ms", "p95_itl_ms", "max_itl_ms",
                    "peak_output_throughput", "concurrency", "median_e2e_latency_ms"):
            assert key in r
    prompts = [tuple(b["prompt"]) for b in fake_server.state.bodies]
    assert len(set(prompts)) == 18  # fresh prompts for every run of the sweep
    assert all(0 <= t < 1000 and len(p) == 16 for p in prompts for t in p)
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Sweep" in text
    assert "Output token throughput (tok/s)" in text


def test_warmup_then_run_with_chat(fake_server: FakeServer, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.jsonl"
    rc = run_bench(["--url", fake_server.url, "--api", "chat", "--num-prompts", "3",
                    "--max-concurrency", "3", "--output-len", "40", "--output-json", str(out),
                    "--no-progress"])
    assert rc == 0
    bodies = fake_server.state.bodies
    assert len(bodies) == 4 and bodies[0]["max_tokens"] == 32  # warm-up first, <= 32 tokens
    assert all(isinstance(b["messages"][0]["content"], str) for b in bodies)
    (run,) = _lines(out)
    assert run["completed"] == 3 and run["server"]["api"] == "chat"
    assert "--api chat sends text" in capsys.readouterr().out


def test_foreign_server_needs_vocab_or_text(fake_server: FakeServer, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    fake_server.state.options.engine = None  # no /v1/engine
    rc = run_bench(["--url", fake_server.url, "--num-prompts", "2", "--no-warmup",
                    "--no-progress"])
    assert rc == 2
    assert "pass --vocab-size N or --text-prompts" in capsys.readouterr().err
    out = tmp_path / "b.jsonl"
    rc = run_bench(["--url", fake_server.url, "--num-prompts", "2", "--no-warmup",
                    "--no-progress", "--text-prompts", "--output-json", str(out)])
    assert rc == 0
    (run,) = _lines(out)
    assert run["engine"] is None and run["device"] is None and run["completed"] == 2
    printed = capsys.readouterr().out
    assert "no /v1/engine" in printed and "estimates" in printed
    rc = run_bench(["--url", fake_server.url, "--num-prompts", "2", "--no-warmup",
                    "--no-progress", "--vocab-size", "50", "--model", "mine"])
    assert rc == 0 and fake_server.state.bodies[-1]["model"] == "mine"
    assert all(t < 50 for t in fake_server.state.bodies[-1]["prompt"])


def test_failed_requests_reported(fake_server: FakeServer, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    fake_server.state.options.fail_status = 500
    out = tmp_path / "b.jsonl"
    rc = run_bench(["--url", fake_server.url, "--num-prompts", "3", "--no-warmup",
                    "--no-progress", "--output-json", str(out)])
    assert rc == 1  # the run completed nothing
    (run,) = _lines(out)
    assert run["failed"] == 3 and run["completed"] == 0
    assert run["errors"] == [{"error": "HTTP 500: injected failure", "count": 3}]
    assert "injected failure" in capsys.readouterr().out


def test_usage_mismatch_warned(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.state.options.usage_extra_tokens = 1
    out = tmp_path / "b.jsonl"
    assert run_bench(["--url", fake_server.url, "--num-prompts", "2", "--no-warmup",
                      "--no-progress", "--output-len", "3", "--output-json", str(out)]) == 0
    (run,) = _lines(out)
    assert run["usage_mismatches"] == 2
    assert run["total_output_tokens"] == 8 and run["total_streamed_tokens"] == 6
    assert any("!= the server's usage" in w for w in run["warnings"])


def test_bad_flags(fake_server: FakeServer, capsys: pytest.CaptureFixture) -> None:
    assert run_bench(["--url", fake_server.url, "--max-concurrency", "2,x"]) == 2
    assert "--max-concurrency: 'x' is not an integer" in capsys.readouterr().err
    assert run_bench(["--url", fake_server.url, "--workload", "sharegpt", "--no-warmup"]) == 2
    assert "needs --dataset-path" in capsys.readouterr().err
    assert run_bench(["--url", "http://127.0.0.1:9", "--no-warmup"]) == 2
    assert "cannot reach the server at http://127.0.0.1:9" in capsys.readouterr().err


def test_server_that_dies_shows_its_log(capsys: pytest.CaptureFixture) -> None:
    rc = run_bench(["--preset", "no-such-preset", "--server-timeout", "60", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exited with code" in err and "before it was ready" in err
    assert "moeserve.cli serve" in err and "--preset no-such-preset" in err
    log = re.search(r"its log \((\S+)\) ends", err)
    assert log is not None and Path(log.group(1)).is_file()  # kept for the user to read
    Path(log.group(1)).unlink()


def test_flags_parse_defaults() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    a = parser.parse_args([])
    assert a.range_ratio == 1.0 and a.request_rate == float("inf") and a.warmup is True
    assert a.ignore_eos is True and a.workers == 1 and a.api == "completions"
    assert parser.parse_args(["--no-ignore-eos", "--no-warmup"]).ignore_eos is False
    assert parser.parse_args(["--max-concurrency", "256", "512"]).max_concurrency == ["256",
                                                                                     "512"]


def test_server_process_waits_for_ready_and_stops() -> None:
    # the fake server stands in for `moeserve serve` (same flags), started as a subprocess
    server = ServerProcess("tiny-moe", "--delay 0", module="tests.bench.fake_server",
                           ready_timeout_s=30)
    assert server.cmd[3:5] == ["serve", "--host"] and "--preset" in server.cmd
    with server:
        assert first_model(server.url, None) == "fake-model"
        assert get_json(server.url, "/v1/engine")["capacity_report"]["vocab_size"] == 1000
        assert server.proc is not None and server.proc.poll() is None
    assert server.proc.returncode is not None  # SIGTERM ended it
    assert not Path(server.log.name).exists()  # a clean stop leaves no log behind
    with pytest.raises(ValueError, match="cannot reach the server"):
        get_json(server.url, "/v1/models")


def test_server_that_dies_during_the_run_leaves_its_log(capfd: pytest.CaptureFixture) -> None:
    # a server that exits by itself: the bench says so and shows the log's end
    server = ServerProcess("tiny-moe", "--delay 0", module="tests.bench.fake_server",
                           ready_timeout_s=30)
    with server:
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
    err = capfd.readouterr().err
    assert f"the server exited with code -9 during the run; its log ({server.log.name}):" in err
    assert f"fake server on port {server.port}" in err  # the log's end, printed
    assert Path(server.log.name).exists()
    Path(server.log.name).unlink()


def test_the_engine_death_phrase_is_what_the_server_logs() -> None:
    # the bench recognises a dead engine by the words `moeserve serve` logs for it
    from moeserve.bench.server import ENGINE_DIED
    from moeserve.server.process import launch

    assert f'logger.error("{ENGINE_DIED}:' in Path(launch.__file__).read_text()


def test_server_whose_engine_died_shows_the_traceback(capfd: pytest.CaptureFixture) -> None:
    # the engine died and the server is still ending its requests when the bench stops it:
    # the engine's traceback, through its exception line, not the 503s logged after it
    server = ServerProcess("tiny-moe", "--delay 0", module="tests.bench.fake_server",
                           ready_timeout_s=30)
    with server:
        server.log.write(b"Process moeserve-engine:\nTraceback (most recent call last):\n"
                         b'  File "core.py", line 1, in step\n    launch()\n'
                         b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 864 MiB\n"
                         b"ERROR the engine process died: ending every request with an error\n"
                         + b"INFO POST /v1/completions: 503\n" * 100)
    err = capfd.readouterr().err
    assert "the server lost its engine during the run" in err
    assert 'Traceback (most recent call last):\n  File "core.py", line 1, in step' in err
    assert err.rstrip().endswith("Tried to allocate 864 MiB")
    assert Path(server.log.name).exists()
    Path(server.log.name).unlink()


def test_find_key() -> None:
    doc = {"a": {"b": [{"vocab_size": 7}]}, "engine_config": {"device": "cuda"}, "device": None}
    assert find_key(doc, "vocab_size") == 7 and find_key(doc, "device") == "cuda"
    assert find_key(None, "x") is None


def test_git_commit_of_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOESERVE_GIT_COMMIT", raising=False)
    root = Path(server_mod.__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    git = git_commit()
    assert git["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert isinstance(git["dirty"], bool) == (head.returncode == 0)


def test_git_commit_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "_PACKAGE_ROOT", tmp_path)  # not a checkout
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "abc123")
    assert git_commit() == {"commit": "abc123", "dirty": None}
    monkeypatch.delenv("MOESERVE_GIT_COMMIT")
    (tmp_path / "GIT_COMMIT").write_text("def456\n")
    assert git_commit() == {"commit": "def456", "dirty": None}
    (tmp_path / "GIT_COMMIT").unlink()
    assert git_commit() == {"commit": None, "dirty": None}


def test_vocab_size_from_engine_or_model_config(tmp_path: Path) -> None:
    assert vocab_size_of({"capacity_report": {"vocab_size": 9}}) == (9, "GET /v1/engine")
    preset = {"capacity_report": {"engine_config": {"model": "tiny-moe"}}}
    assert vocab_size_of(preset) == (512, "preset tiny-moe")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 77}}))
    folder = {"capacity_report": {"engine_config": {"model": str(tmp_path)}}}
    assert vocab_size_of(folder) == (77, str(tmp_path / "config.json"))
    missing = {"capacity_report": {"engine_config": {"model": str(tmp_path / "nope")}}}
    assert vocab_size_of(missing) == (None, "") and vocab_size_of(None) == (None, "")


def test_moeserve_engine_without_vocab_uses_its_preset(fake_server: FakeServer, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    # moeserve's /v1/engine names the model in engine_config; its vocabulary is the preset's
    fake_server.state.options.engine = {"capacity_report": {"engine_config": {
        "model": "tiny-moe", "device": "cpu"}}}
    assert run_bench_argv(["--url", fake_server.url, "--num-prompts", "4", "--input-len",
                           "64", "--no-warmup", "--no-progress"]) == 0
    ids = [t for b in fake_server.state.bodies for t in b["prompt"]]
    assert len(ids) == 256 and max(ids) < 512 and max(ids) > 256
    assert "vocabulary size from preset tiny-moe" in capsys.readouterr().out
    assert run_bench_argv(["--url", fake_server.url, "--num-prompts", "1", "--no-warmup",
                           "--no-progress", "--output-json", str(tmp_path / "r.jsonl")]) == 0
    (run,) = _lines(tmp_path / "r.jsonl")
    assert run["server"]["vocab_size"] == 512
    assert run["server"]["vocab_source"] == "preset tiny-moe"
    assert not any("vocab" in w or "engine" in w for w in run["warnings"])  # info, not a warning


def test_git_commit_env_overrides_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied tree (the GPU machine) can carry a stale .git: the explicit variable wins."""
    monkeypatch.setenv("MOESERVE_GIT_COMMIT", "feed42")
    assert git_commit() == {"commit": "feed42", "dirty": None}


def test_extra_body_must_be_a_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    assert parser.parse_args(["--extra-body", '{"top_k": 5}']).extra_body == {"top_k": 5}
    for bad, why in (("[1]", "must be a JSON object"), ("{x", "not JSON")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--extra-body", bad])
        assert why in capsys.readouterr().err
