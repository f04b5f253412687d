"""SamplingParams.prompt_logprobs through the engine: each prompt token's logprob after the ones
before it, with the top n, equal to what decoding that prefix reports, on every path a prompt
takes (one step, chunks, overlap, a prefix-cache hit skipped, preemption's recompute)."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine.llm import CompletionOutput
from tests.engine.conftest import tiny_llm

N = 3


def _prompt(llm: LLM) -> list[int]:
    """[5, 6, 7] and its 13 greedy tokens: from entry 3 on, each prompt token is the top one."""
    head = [5, 6, 7]
    return head + llm.generate([head], SamplingParams(max_tokens=13, temperature=0.0,
                                                      ignore_eos=True))[0].token_ids


def _reference(llm: LLM, prompt: list[int]) -> list[tuple[list[int], list[float]]]:
    """Entry k's top n from decoding prompt[:k] with logprobs=N, one request a prefix."""
    outs = llm.generate([prompt[:k] for k in range(1, len(prompt))],
                        SamplingParams(max_tokens=1, temperature=0.0, logprobs=N))
    return [(o.logprobs[0].top_token_ids, o.logprobs[0].top_logprobs) for o in outs]


def _check(got: CompletionOutput, prompt: list[int], reference: list) -> None:
    entries = got.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for k in range(1, len(prompt)):
        ids, lps = reference[k - 1]
        entry = entries[k]
        assert entry.top_token_ids == ids, k
        assert entry.top_logprobs == pytest.approx(lps, abs=1e-4), k
        if k >= 3:  # prompt[k] is the greedy token after prompt[:k]: the top one
            assert ids[0] == prompt[k]
            assert entry.token_logprob == pytest.approx(lps[0], abs=1e-4), k


@pytest.mark.parametrize("engine", [
    {}, {"max_num_batched_tokens": 4, "enable_chunked_prefill": True},
    {"max_num_batched_tokens": 5, "enable_chunked_prefill": True, "async_scheduling": True}],
    ids=["one-step", "chunked", "chunked-overlap"])
def test_prompt_logprobs_equal_decoding_each_prefix(engine: dict, device: str) -> None:
    llm = tiny_llm(device, **engine)
    prompt = _prompt(llm)
    reference = _reference(tiny_llm(device), prompt)
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=N),
              SamplingParams(max_tokens=3, temperature=0.0)]
    got = llm.generate([prompt, prompt[:6]], params)
    _check(got[0], prompt, reference)
    assert got[1].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_them() -> None:
    llm = LLM("tiny-moe", device="cpu", block_size=4, enable_prefix_caching=True)
    prompt = _prompt(llm)
    reference = _reference(llm, prompt)
    llm.generate([prompt], SamplingParams(max_tokens=1))  # its blocks cached
    again = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                  prompt_logprobs=N))[0]
    assert again.num_cached_tokens == 0
    _check(again, prompt, reference)
    hit = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert hit.num_cached_tokens > 0  # others still hit


def test_preemption_reports_each_entry_once() -> None:
    """Requests that outgrow the cache preempt the last running one, which recomputes its
    prompt: its entries come once each, equal to a run without preemption."""
    llm = LLM("tiny-moe", device="cpu", block_size=4, num_blocks=13, max_model_len=48,
              max_running_requests=4, enable_prefix_caching=False)
    prompt = _prompt(llm)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=N)
    got = llm.generate([prompt] * 3, params)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    alone = LLM("tiny-moe", device="cpu").generate([prompt], params)[0]
    for out in got:
        assert len(out.prompt_logprobs) == len(prompt)
        for a, b in zip(out.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
            assert a.top_token_ids == b.top_token_ids
            assert a.token_logprob == pytest.approx(b.token_logprob, abs=1e-4)
    assert not llm.engine.scheduler.prompt_logprobs  # nothing left behind


@pytest.mark.parametrize("value", [-1, 21, True])
def test_prompt_logprobs_is_validated(value: object) -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)
