"""A forward that runs out of device memory does not take the engine down (engine/oom.py): the
step's requests are preempted and recomputed, exactly as in a run without the fault; a request
that is the largest of two failed steps fails alone with an error naming the limits; later
requests are served. Faults are injected through the runner's launch (MOESERVE_FAULT_INJECT
"oom" / "oom_once", envs.py), which raises torch.OutOfMemoryError as an eager forward's
allocation would; an out-of-memory step result is injected on the pending output."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve import LLM, SamplingParams, envs
from moeserve.types import FinishReason

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tiny(**kw: object) -> LLM:
    return LLM("tiny-moe", device="cpu", max_model_len=64, **kw)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(4 + 5 * i)] for i in range(4)]  # r3 longest


@pytest.fixture(scope="module")
def clean() -> list[list[int]]:
    return [r.token_ids for r in _tiny().generate(_prompts(), GREEDY)]


def _run(llm: LLM) -> list:
    ids = [llm.add_request(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(_prompts())]
    while llm.has_unfinished_requests():
        llm.step()
        llm.engine.scheduler.check_integrity()
    return [llm.result(i) for i in ids]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_transient_oom_loses_nothing(monkeypatch: pytest.MonkeyPatch,
                                       clean: list[list[int]], overlap: bool) -> None:
    """One out-of-memory step (r1 in it): every request of it is recomputed and all finish
    with the clean run's tokens; the preemptions are counted."""
    monkeypatch.setenv(envs.FAULT_INJECT, "oom_once:r1")
    llm = _tiny(async_scheduling=overlap)
    results = _run(llm)
    for i, r in enumerate(results):
        assert r.finish_reason is FinishReason.LENGTH and r.error is None
        assert r.token_ids == clean[i]
    engine = llm.engine
    assert engine.oom.num_recoveries == 1 and engine.oom.num_failed == 0
    assert engine.scheduler.stats.num_preemptions >= 1
    assert engine.scheduler.stats.kv_usage == 0.0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_largest_of_two_failed_steps_fails_alone(monkeypatch: pytest.MonkeyPatch,
                                                     clean: list[list[int]],
                                                     overlap: bool) -> None:
    """r3 (the longest prompt) makes every step holding it run out of memory: the first time
    all are preempted, the second r3 fails with an error naming the limits; the others finish
    exactly as without it, and the engine serves a request after."""
    monkeypatch.setenv(envs.FAULT_INJECT, "oom:r3")
    llm = _tiny(async_scheduling=overlap)
    results = _run(llm)
    bad = results[3]
    assert bad.finish_reason is FinishReason.ERROR and bad.token_ids == []
    assert "out of device memory" in bad.error and "max_num_batched_tokens" in bad.error
    assert "injected: CUDA out of memory" in bad.error
    for i in range(3):
        assert results[i].finish_reason is FinishReason.LENGTH and results[i].error is None
        assert results[i].token_ids == clean[i]
    engine = llm.engine
    assert engine.oom.num_recoveries == 2 and engine.oom.num_failed == 1
    assert engine.scheduler.stats.num_failed == 1 and not engine.scheduler.requests
    assert llm.generate(_prompts()[0], GREEDY)[0].token_ids == clean[0]


def test_an_oom_result_discards_the_step_launched_on_it(monkeypatch: pytest.MonkeyPatch,
                                                        clean: list[list[int]]) -> None:
    """With overlap, a step whose result raises out of memory (after the next step was
    launched on its tokens on the device): both steps' requests are recomputed and finish with
    the clean tokens."""
    llm = _tiny(async_scheduling=True)
    runner = llm.engine.runner
    launch, state = runner.launch, {"steps": 0}

    def failing_launch(out):  # the third launch's result raises
        pending = launch(out)
        state["steps"] += 1
        if state["steps"] == 3:
            def result():
                raise torch.OutOfMemoryError("injected at result: CUDA out of memory")
            pending.result = result
        return pending

    monkeypatch.setattr(runner, "launch", failing_launch)
    results = _run(llm)
    for i, r in enumerate(results):
        assert r.finish_reason is FinishReason.LENGTH and r.token_ids == clean[i]
    assert llm.engine.oom.num_recoveries == 1


def test_retry_later_and_fail_request_keep_the_scheduler_whole() -> None:
    """Scheduler.retry_later preempts running requests (placeholders dropped, blocks out of
    the prefix cache), ignores unknown ids; fail_request finishes one with the error."""
    llm = _tiny(enable_prefix_caching=True)
    for i, p in enumerate(_prompts()):
        llm.add_request(p * 2, GREEDY, request_id=f"r{i}")
    llm.step()
    sched = llm.engine.scheduler
    assert len(sched.running) == 4
    blocks = {i: list(sched.pool.block_tables[i]) for i in ("r0", "r1", "r2")}
    assert any(sched.pool._block_hash[b] is not None for b in blocks["r2"])  # prefilled, cached
    sched.running[0].num_output_placeholders = 1  # as if a token were in flight
    assert sorted(sched.retry_later(["r0", "r2", "nobody"])) == ["r0", "r2"]
    sched.check_integrity()
    assert [r.request_id for r in sched.waiting][:2] == ["r0", "r2"]
    assert all(r.num_output_placeholders == 0 and r.num_computed_tokens == 0
               for r in sched.waiting)
    assert all(sched.pool._block_hash[b] is None for b in blocks["r0"] + blocks["r2"])
    assert any(sched.pool._block_hash[b] is not None for b in blocks["r1"])  # untouched
    out = sched.fail_request("r1", "boom")
    assert out is not None and out.finished and out.error == "boom"
    assert out.finish_reason is FinishReason.ERROR
    assert sched.fail_request("r1", "again") is None
    sched.check_integrity()
    while llm.has_unfinished_requests():
        llm.step()
    sched.check_integrity()


def test_the_recoveries_reach_the_stats_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineStats.num_oom_steps is served as moeserve_engine_oom_steps on /metrics."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from moeserve.engine.process.protocol import EngineStats
    from moeserve.server.metrics import ServerMetrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    client = SimpleNamespace(stats=EngineStats(num_oom_steps=2), num_in_flight=0, alive=True)
    text = generate_latest(ServerMetrics(client).registry).decode()  # type: ignore[arg-type]
    assert "moeserve_engine_oom_steps_total 2.0" in text
