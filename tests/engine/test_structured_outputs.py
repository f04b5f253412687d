"""Structured outputs through the engine (tiny-moe, random weights, byte tokenizer): whatever
the model would write, the output is what the grammar allows; the other requests of the batch
are untouched; overlap scheduling, multi-step decode, preemption and a bad grammar each keep
those properties. On CPU, and on the GPU machine (`pytest -m gpu`)."""

from __future__ import annotations

import json
import re
import threading

import jsonschema_rs
import pytest

from moeserve import LLM, SamplingParams, StructuredOutput
from moeserve.structured.grammars import Masks
from moeserve.types import FinishReason

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["red", "green", "blue"]}},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
PROMPTS = ["hello", "the quick brown fox", "1, 2, 3,", "{"]


def _llm(device: str, **kw: object) -> LLM:
    if device == "cuda":
        kw.setdefault("mem_fraction", 0.05)  # a tiny model: leave the GPU's memory alone
    return LLM("tiny-moe", device=device, **{"max_model_len": 256, **kw})


def _params(structured: StructuredOutput | None, seed: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 96), temperature=1.0, seed=seed,
                          structured=structured, **kw)


def _check_schema(text: str) -> None:
    jsonschema_rs.validate(SCHEMA, json.loads(text))


KINDS = [
    (StructuredOutput.json_schema(SCHEMA), _check_schema),
    (StructuredOutput("regex", r"[a-z]{2,5}-\d{3}"),
     lambda t: re.fullmatch(r"[a-z]{2,5}-\d{3}", t) or 1 / 0),
    (StructuredOutput.choice(["yes", "no", "not sure"]),
     lambda t: t in ("yes", "no", "not sure") or 1 / 0),
    (StructuredOutput("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]/ | "x"'),
     lambda t: re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", t) or 1 / 0),
]


@pytest.mark.parametrize("kind", range(len(KINDS)), ids=[k[0].kind for k in KINDS])
def test_every_output_is_what_the_grammar_allows(device: str, kind: int) -> None:
    structured, check = KINDS[kind]
    llm = _llm(device)
    results = llm.generate(PROMPTS, [_params(structured, seed) for seed in range(len(PROMPTS))])
    for r in results:
        assert r.finish_reason is FinishReason.STOP, (r.text, r.finish_reason)
        check(r.text)


@pytest.mark.parametrize("engine", [{"async_scheduling": True}, {"async_scheduling": False},
                                    {"num_continuous_decode_steps": 4}],
                         ids=["overlap", "sync", "multi_step"])
def test_the_other_requests_are_untouched(device: str, engine: dict) -> None:
    """Seeded requests beside structured ones sample what they sample alone; the structured
    ones give the same tokens in every engine mode."""
    plain = [_params(None, seed, max_tokens=24, ignore_eos=True) for seed in (11, 12)]
    structured = [_params(StructuredOutput.json_schema(SCHEMA), seed) for seed in (21, 22)]
    alone = _llm(device, **engine).generate(PROMPTS[:2], plain)
    llm = _llm(device, **engine)
    mixed = llm.generate(PROMPTS, plain + structured)
    assert [r.token_ids for r in mixed[:2]] == [r.token_ids for r in alone]
    reference = _llm(device, async_scheduling=False).generate(PROMPTS[2:], structured)
    assert [r.token_ids for r in mixed[2:]] == [r.token_ids for r in reference]
    for r in mixed[2:]:
        _check_schema(r.text)
    waits = llm.engine.structured.num_overlap_waits
    assert waits > 0 if engine.get("async_scheduling") else waits == 0


def test_multi_step_decode_runs_single_steps_under_a_grammar(device: str) -> None:
    """40 tokens under a grammar take 40 engine steps (a prefill and 39 single decode steps);
    the same request without one runs 4 decode tokens a step."""
    llm = _llm(device, num_continuous_decode_steps=4)
    stats = llm.engine.scheduler.stats
    for structured, steps in ((StructuredOutput("regex", "[a-z]{40}"), 40), (None, 11)):
        before = stats.num_scheduled_steps
        [r] = llm.generate(PROMPTS[:1], _params(structured, 1, max_tokens=40, ignore_eos=True))
        assert len(r.token_ids) == 40
        assert stats.num_scheduled_steps - before == steps


def test_a_grammar_stops_its_request_even_past_eos(device: str) -> None:
    """ignore_eos: the grammar's end still ends the request (nothing may follow it)."""
    llm = _llm(device)
    [r] = llm.generate(PROMPTS[:1], _params(StructuredOutput.choice(["done"]), 3,
                                            ignore_eos=True))
    assert r.text == "done" and r.finish_reason is FinishReason.STOP


def test_preempted_structured_requests_resume_their_grammar(device: str) -> None:
    llm = _llm(device, block_size=4, num_blocks=30, max_running_requests=4, max_model_len=112)
    params = [_params(StructuredOutput.json_schema(SCHEMA), seed) for seed in range(4)]
    results = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    reference = _llm(device).generate(PROMPTS, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]


def test_a_bad_grammar_refuses_its_request_alone(device: str) -> None:
    llm = _llm(device)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.add_request(PROMPTS[0], _params(StructuredOutput("regex", "(a"), 1))
    assert not llm.has_unfinished_requests() and len(llm.engine.structured.grammars) == 0
    [r] = llm.generate(PROMPTS[:1], _params(StructuredOutput("regex", "ok"), 1))
    assert r.text == "ok"


def test_a_refused_token_fails_its_request_alone(device: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask the sampler does not apply (a broken mask) makes the grammar refuse a token:
    that request fails with the reason; the others finish."""
    from moeserve.runner import step_sampling

    monkeypatch.setattr(step_sampling, "mask_tokens_", lambda logits, rows, bitmask: None)
    llm = _llm(device)
    results = llm.generate(PROMPTS[:2], [
        _params(StructuredOutput("regex", "a{30}"), 1),
        _params(None, 2, max_tokens=8, ignore_eos=True)])
    assert results[0].finish_reason is FinishReason.ERROR
    assert "is not allowed by the request's structured output" in results[0].error
    assert results[1].finish_reason is FinishReason.LENGTH and len(results[1].token_ids) == 8
    assert llm.engine.structured.num_refused_tokens == 1


def test_overlap_a_grammar_steps_forward_runs_before_the_step_before_settles(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap kept: step N+1's forward is enqueued first (sampling deferred), then step N's
    tokens are read and accepted, then N+1's masks are built (on the masks thread) and its
    sampling is enqueued at the next step, before anything else is launched (the last step's,
    once its requests ended, waits for a step that no one takes)."""
    llm = _llm(device, async_scheduling=True)
    engine, calls = llm.engine, []
    launch, update, sample = (engine.runner.launch, engine.scheduler.update,
                              engine.runner.sample_deferred)

    def spy(name, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name + ("(deferred)" if kwargs.get("defer_sampling") else ""))
            return fn(*args, **kwargs)
        return call

    engine.runner.launch = spy("launch", launch)
    engine.scheduler.update = spy("update", update)
    engine.runner.sample_deferred = spy("sample", sample)
    threads, compute = [], Masks.compute
    monkeypatch.setattr(Masks, "compute", lambda masks: threads.append(
        threading.current_thread().name) or compute(masks))
    [r] = llm.generate(PROMPTS[:1], _params(StructuredOutput("regex", "[a-z]{12}"), 1))
    assert re.fullmatch("[a-z]{12}", r.text)
    late = [i for i, c in enumerate(calls) if c == "launch(deferred)"]
    assert late and engine.structured.num_overlap_waits == len(late)
    for i in late:
        assert calls[i + 1] == "update" and calls[i + 2:i + 3] in (["sample"], []), calls
    assert calls[-2:] == ["launch(deferred)", "update"] and engine.structured.deferred
    # the first grammar step's masks (nothing in flight) on the engine's thread, the others'
    # on the masks thread (the last deferred step has no row: its request ended just before)
    assert threads[0] == threading.current_thread().name and len(threads) == len(late)
    assert all(name.startswith("moeserve-masks") for name in threads[1:]), threads


def test_a_late_steps_wall_is_the_whole_iteration(device: str, monkeypatch: object) -> None:
    """The wall recorded for a step whose sampling was deferred (its masks built while the
    loop went on) takes in that sampling: the step that samples it also settles it, and
    records its wall after (the doctor's cpu_bound_step reads it). A clock injected into the
    engine core moves only while a deferred sampling is enqueued; the last one never runs (its
    requests ended before it, and generate takes no step after)."""
    from types import SimpleNamespace

    from moeserve.engine import core, step_counters

    now = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(core, "time", clock)  # type: ignore[attr-defined]
    llm = _llm(device, async_scheduling=True)
    engine, walls = llm.engine, []
    sample, record = engine.runner.sample_deferred, step_counters.StepCounters.record

    def slow_sample(*args, **kwargs):  # type: ignore[no-untyped-def]
        now[0] += 1.0  # host work of the iteration that settles the step before
        return sample(*args, **kwargs)

    def spy(counters, out, outputs, seconds):  # type: ignore[no-untyped-def]
        walls.append(seconds)
        return record(counters, out, outputs, seconds)

    engine.runner.sample_deferred = slow_sample
    monkeypatch.setattr(step_counters.StepCounters, "record", spy)  # type: ignore[attr-defined]
    llm.generate(PROMPTS[:1], _params(StructuredOutput("regex", "[a-z]{12}"), 1))
    late = engine.structured.num_overlap_waits
    assert late > 1 and engine.structured.deferred
    assert sum(w >= 1.0 for w in walls) == late - 1 and now[0] == late - 1, walls


def _greedy(structured: StructuredOutput, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)


def test_a_deferred_sampling_out_of_memory_loses_nothing(device: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar step's sampling (deferred to the next step, after its masks) runs out of
    device memory: that step and the one planned on its tokens are recomputed, and every
    request ends with the text of a run without the fault."""
    import torch

    params = [_greedy(KINDS[k][0]) for k in range(len(PROMPTS))]
    clean = [(r.text, r.finish_reason) for r in
             _llm(device, async_scheduling=True).generate(PROMPTS, params)]
    llm = _llm(device, async_scheduling=True)
    sample, calls = llm.engine.runner.sample_deferred, []

    def failing(pending, out):  # type: ignore[no-untyped-def]
        calls.append(out)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return sample(pending, out)

    monkeypatch.setattr(llm.engine.runner, "sample_deferred", failing)
    results = llm.generate(PROMPTS, params)
    # NOTE: the clean run's finish reasons, not STOP: on CUDA a greedy reply may end at
    # max_tokens before its grammar completes (the GPU run found it)
    assert [(r.text, r.finish_reason) for r in results] == clean and len(calls) > 3
    assert llm.engine.oom.num_recoveries == 1 and llm.engine.scheduler.stats.num_preemptions


def test_a_request_aborted_while_its_masks_are_built_leaves_the_others_whole(
        device: str) -> None:
    """An abort between a step's masks begun and its sampling (the API's disconnect, taken in
    by the loop then): the request ends aborted, its grammar is dropped, the others end with
    the text of a run without it."""
    params = [_greedy(KINDS[0][0]), _greedy(KINDS[1][0])]
    clean = _llm(device, async_scheduling=True).generate(PROMPTS[:2], params)[1].text
    llm = _llm(device, async_scheduling=True)
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
    while not llm.engine.structured.deferred:
        llm.step()
    llm.abort(ids[0])
    while llm.has_unfinished_requests():
        llm.step()
        llm.engine.scheduler.check_integrity()
    aborted, other = (llm.result(i) for i in ids)
    assert aborted.finish_reason is FinishReason.ABORT and other.text == clean
    assert ids[0] not in llm.engine.structured.grammars


def test_masks_at_once_on_the_engines_thread_give_the_same_outputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MOESERVE_GRAMMAR_MASKS_THREAD=0 (the A/B) builds every step's masks on the engine's
    thread, with the same outputs as the masks thread's."""
    from moeserve import envs

    params = [_greedy(KINDS[k][0]) for k in range(len(PROMPTS))]
    threaded = [r.text for r in _llm("cpu", async_scheduling=True).generate(PROMPTS, params)]
    monkeypatch.setenv(envs.GRAMMAR_MASKS_THREAD, "0")
    threads, compute = [], Masks.compute
    monkeypatch.setattr(Masks, "compute", lambda masks: threads.append(
        threading.current_thread().name) or compute(masks))
    llm = _llm("cpu", async_scheduling=True)
    assert [r.text for r in llm.generate(PROMPTS, params)] == threaded
    assert llm.engine.structured.num_overlap_waits > 1
    assert set(threads) == {threading.current_thread().name}


def test_the_tokens_a_grammar_forbids_are_not_among_the_top_logprobs(device: str) -> None:
    """logprobs 20 under a choice that allows one or two tokens a step: each step's top list
    holds only the allowed tokens (finite logprobs, the sampled one among them), not the
    forbidden ones at -inf (which the API would write as null)."""
    llm = _llm(device)
    [r] = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, logprobs=20,
        structured=StructuredOutput.choice(["ab", "ac", "xyz"])))
    assert r.text in ("ab", "ac", "xyz") and r.logprobs is not None
    for token, lp in zip(r.token_ids, r.logprobs):
        assert 1 <= len(lp.top_logprobs) <= 2 and len(lp.top_token_ids) == len(lp.top_logprobs)
        assert all(v > float("-inf") for v in [lp.token_logprob, *lp.top_logprobs])
        assert token in lp.top_token_ids


@pytest.mark.parametrize("overlap", [True, False])
def test_a_reasoning_budget_forces_its_end_token(device: str, overlap: bool) -> None:
    """reasoning_budget (end, n, -1): at most n tokens before `end`, which is then forced; the
    others of the batch untouched; a grammar that starts after the end token holds from
    there."""
    end = ord("\n")
    llm = _llm(device, async_scheduling=overlap)
    free = _greedy(None, max_tokens=24)
    plain = llm.generate(PROMPTS, [free] * len(PROMPTS))
    budgeted = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                              reasoning_budget=(end, 5, -1))
    results = llm.generate(PROMPTS, [budgeted, free, budgeted, free])
    for i in (1, 3):
        assert results[i].token_ids == plain[i].token_ids  # untouched
    for i in (0, 2):
        ids = results[i].token_ids
        assert end not in plain[i].token_ids[:6]  # (the model would not write it so soon)
        assert ids.index(end) == 5 and ids[:5] == plain[i].token_ids[:5], ids  # forced 6th
    after = StructuredOutput("regex", "[0-9]{3}", start_after=end)
    [held] = llm.generate(PROMPTS[:1], SamplingParams(
        max_tokens=40, temperature=0.0, reasoning_budget=(end, 3, -1), structured=after))
    assert held.token_ids.index(end) <= 3 and held.finish_reason is FinishReason.STOP
    tail = held.text.partition("\n")[2]
    assert len(tail) == 3 and tail.isdigit()
