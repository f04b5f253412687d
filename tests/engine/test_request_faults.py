"""A fault that belongs to one request fails that request alone; the others are served exactly as
in a run without it. What belongs to no request (a failing forward) still fails the engine loudly,
unless it ran out of device memory (test_oom_recovery.py).

Faults are raised with the injection hook (MOESERVE_FAULT_INJECT, read in envs.py), for a chosen
request id, through the real isolation paths: the sampler retried row by row, the finite check on
the logits, the detokenizer. Also: sampling values at the edges of their ranges (a top_p or a
temperature that rounds to 0 in fp32) give the greedy answer instead of garbage or a crash.
"""

from __future__ import annotations

import random

import pytest

from moeserve import LLM, SamplingParams, envs
from moeserve.types import FinishReason

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _tiny(**kw: object) -> LLM:
    return LLM("tiny-moe", device="cpu", max_model_len=64, **kw)


def _prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(4 + 5 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def clean() -> list[list[int]]:
    return [r.token_ids for r in _tiny().generate(_prompts(), GREEDY)]


def _run(llm: LLM, params: SamplingParams = GREEDY, bad: int = 1) -> list:
    """Submit the prompts as r0..r3 (r{bad} is the faulted one), run them to the end."""
    ids = [llm.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(_prompts())]
    while llm.has_unfinished_requests():
        llm.step()
    llm.engine.scheduler.check_integrity()
    return [llm.result(i) for i in ids]


@pytest.mark.parametrize("kind,needle", [("sample", "sampling failed: InjectedFault"),
                                         ("nan", "not finite"),
                                         ("detokenize", "detokenization failed")])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_fault_fails_that_request_alone(
        monkeypatch: pytest.MonkeyPatch, clean: list[list[int]], kind: str, needle: str,
        overlap: bool) -> None:
    monkeypatch.setenv(envs.FAULT_INJECT, f"{kind}:r1")
    llm = _tiny(async_scheduling=overlap)
    results = _run(llm)
    bad = results[1]
    assert bad.finish_reason is FinishReason.ERROR
    assert needle in bad.error
    for i in (0, 2, 3):
        assert results[i].finish_reason is FinishReason.LENGTH and results[i].error is None
        assert results[i].token_ids == clean[i]
    stats = llm.engine.scheduler.stats
    assert stats.num_failed == 1 and stats.kv_usage == 0.0
    assert not llm.engine.scheduler.requests  # nothing left behind; every block is free again
    # the engine goes on serving: a request after the fault gets the clean answer
    assert llm.generate(_prompts()[0], GREEDY)[0].token_ids == clean[0]


def test_a_fault_of_every_row_of_several_is_not_attributed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When each of several rows fails alone, the sampler is to blame, not one request: the
    step raises (loud)."""
    monkeypatch.setenv(envs.FAULT_INJECT, "sample:a,sample:b")
    llm = _tiny()
    llm.add_request([1, 2, 3], GREEDY, request_id="a")
    llm.add_request([4, 5, 6], GREEDY, request_id="b")
    with pytest.raises(envs.InjectedFault, match="sampler fault"):
        while llm.has_unfinished_requests():
            llm.step()


def test_the_one_row_of_a_step_failing_fails_its_request(
        monkeypatch: pytest.MonkeyPatch, clean: list[list[int]]) -> None:
    """A step that samples one row only (here the only request) is that request's fault."""
    monkeypatch.setenv(envs.FAULT_INJECT, "sample:only")
    llm = _tiny()
    llm.add_request([1, 2, 3], GREEDY, request_id="only")
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.result("only").finish_reason is FinishReason.ERROR
    assert llm.generate(_prompts()[1], GREEDY)[0].token_ids == clean[1]  # the engine goes on


def test_a_forward_fault_fails_the_engine_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.FAULT_INJECT, "step:r2")
    llm = _tiny()
    with pytest.raises(envs.InjectedFault, match="step fault"):
        _run(llm)


def test_malformed_fault_spec_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.FAULT_INJECT, "explode:r1")
    with pytest.raises(ValueError, match="MOESERVE_FAULT_INJECT.*'explode:r1'"):
        envs.fault_injection()
    monkeypatch.delenv(envs.FAULT_INJECT)
    assert envs.fault_injection() == {}


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, ignore_eos=True, top_p=1e-46),
    SamplingParams(max_tokens=10, ignore_eos=True, top_p=5e-324),
    SamplingParams(max_tokens=10, ignore_eos=True, top_p=0.0),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=1e-39, top_p=0.9),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=1e-39),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=5e-6, top_k=5, min_p=0.5),
], ids=["top_p 1e-46", "top_p 5e-324", "top_p 0", "temperature 1e-39 + top_p",
        "temperature 1e-39", "temperature 5e-6 + top_k + min_p"])
def test_sampling_values_at_the_edges_give_the_greedy_answer(
        clean: list[list[int]], params: SamplingParams) -> None:
    llm = _tiny()
    results = _run(llm, params)
    assert [r.token_ids for r in results] == clean
    assert llm.generate(_prompts()[2], GREEDY)[0].token_ids == clean[2]  # and the next one


def test_a_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-39).greedy
    assert SamplingParams(temperature=9.9e-6).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
