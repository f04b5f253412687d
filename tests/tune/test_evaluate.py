"""The real evaluator (a `moeserve serve` and a `moeserve bench` per config) on tiny-moe, CPU:
each way a trial can fail is an infeasible Outcome with its kind and reason, never a raise."""

from __future__ import annotations

import threading

import psutil

from moeserve.tune.evaluate import BenchPlan, Outcome, ServerBenchEvaluator, Slo, classify_log
from tests.wait import wait_until

BENCH = ["--input-len", "8", "--output-len", "8"]


def _evaluator(tmp_path, fixed=("--torch-threads", "1"), timeout_s=120.0, slo=None):
    plan = BenchPlan([2], lambda c: 4, lambda c: 4, BENCH)
    return ServerBenchEvaluator("tiny-moe", list(fixed), plan, slo, trial_timeout_s=timeout_s,
                                server_timeout_s=120.0, log_dir=tmp_path / "logs")


def test_a_good_config_has_every_figure_verdicts_and_the_capacity_report(tmp_path):
    out = _evaluator(tmp_path).evaluate({"max_running_requests": 2}, "trial")
    assert out.failure is None and out.value is not None and out.value > 0
    (run,) = out.runs
    assert run["completed"] == 4 and run["max_concurrency"] == 2
    assert {"median_tpot_ms", "p99_ttft_ms", "output_throughput", "duration"} <= set(run)
    assert out.capacity["engine_config"]["scheduler"]["max_running_requests"] == 2
    assert "--max-running-requests 2" in out.command
    assert (tmp_path / "logs").is_dir() and out.extra["server_log"]


def test_a_latency_bound_missed_is_an_slo_failure_with_its_value(tmp_path):
    out = _evaluator(tmp_path, slo=Slo(ttft_ms=1e-6)).evaluate({}, "trial")
    assert out.failure == "slo" and out.value is not None and "TTFT" in out.error
    assert out.extra["slo_excess"] > 0


def test_a_server_that_exits_at_start_up_is_a_startup_failure(tmp_path):
    out = _evaluator(tmp_path, fixed=("--torch-threads", "1", "--max-model-len", "1")
                     ).evaluate({}, "trial")
    assert out.failure == "startup" and out.value is None
    assert "max_model_len" in out.error


def test_a_bench_past_the_trial_time_is_a_timeout(tmp_path, monkeypatch):
    never = tmp_path / "never"  # every engine step waits for this file: no request finishes
    monkeypatch.setenv("MOESERVE_FAULT_INJECT", f"hold_steps:{never}")
    out = _evaluator(tmp_path, timeout_s=3.0).evaluate({}, "trial")
    assert out.failure == "timeout" and out.value is None and "--trial-timeout" in out.error


def test_a_server_that_dies_during_the_bench_is_a_crash(tmp_path, monkeypatch):
    held = tmp_path / "release"
    monkeypatch.setenv("MOESERVE_FAULT_INJECT", f"hold_steps:{held}")
    ev = _evaluator(tmp_path, timeout_s=60.0)
    killed = threading.Event()

    def kill_engine_when_serving() -> None:  # the bench runs, its requests held in the engine
        def procs(word: str) -> list[psutil.Process]:
            found = []
            for p in psutil.Process().children(recursive=True):
                try:  # a child may exit (or be a zombie) between the listing and the read
                    if word in " ".join(p.cmdline()):
                        found.append(p)
                except psutil.Error:
                    continue
            return found

        wait_until(lambda: procs(" bench ") and procs(" serve "), what="the bench running",
                   timeout_s=120)
        for child in procs(" serve ")[0].children():  # the engine (and any helper process)
            try:
                child.kill()
            except psutil.NoSuchProcess:
                continue
        killed.set()

    t = threading.Thread(target=kill_engine_when_serving, daemon=True)
    t.start()
    out: Outcome = ev.evaluate({}, "trial")
    t.join(timeout=60)
    assert killed.is_set()
    assert out.failure == "crash" and out.value is None and "exited" in out.error


def test_out_of_memory_is_told_from_the_log():
    assert classify_log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") == "oom"
    assert classify_log("RuntimeError: CUDA error: out of memory") == "oom"
    assert classify_log("ConfigError: max_model_len") is None


def test_a_confirmation_run_gets_its_prompts_worth_of_the_trial_timeout(tmp_path):
    plan = BenchPlan([64, 1024], lambda c: c, lambda c: 3 * c, BENCH)
    ev = ServerBenchEvaluator("tiny-moe", [], plan, trial_timeout_s=240.0)
    assert ev.bench_limit_s("trial") == 240.0
    assert ev.bench_limit_s("confirm") == 720.0  # the seeds' bad start: 263 s of full W1
    fewer = ServerBenchEvaluator("tiny-moe", [], BenchPlan([8], lambda c: 16, lambda c: 8),
                                 trial_timeout_s=240.0)
    assert fewer.bench_limit_s("confirm") == 240.0  # never less than a trial's
