"""SamplingParams.logit_bias through the engine: every decode path applies it, to its own row."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams
from tests.engine.conftest import tiny_llm

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("engine", [{}, {"num_continuous_decode_steps": 4},
                                    {"async_scheduling": True}],
                         ids=["single-step", "multi-step", "overlap"])
def test_each_row_gets_its_own_bias(engine: dict, device: str) -> None:
    """A +100 bias forces its token at every step of its request (multi-step decode plans and
    overlap scheduling included), a -100 bias keeps the greedy token out, and the request
    without a bias decodes as it does alone."""
    llm = tiny_llm(device, **engine)
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    plain = _tokens(llm, [greedy] * 3)
    banned = plain[2][0]
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                             logit_bias={42: 100.0}),
              greedy,
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True,
                             logit_bias={banned: -100.0})]
    got = _tokens(llm, params)
    assert got[0] == [42] * 9
    assert got[1] == plain[1]
    assert banned not in got[2]


def test_a_bias_outside_the_vocabulary_is_refused_by_name() -> None:
    llm = LLM("tiny-moe", device="cpu")
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocab"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={vocab: 1.0}))


def _reference(llm: LLM, prompt: list[int], presence: float, frequency: float,
               n: int) -> list[int]:
    """Greedy with the penalties written as each step's logit_bias (-presence - frequency x
    count on every token generated so far), one token a call."""
    out: list[int] = []
    for _ in range(n):
        bias = {t: -(presence + frequency * out.count(t)) for t in set(out)}
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                logit_bias=bias)
        out += llm.generate([prompt + out], params)[0].token_ids
    return out


@pytest.mark.parametrize("engine", [{}, {"num_continuous_decode_steps": 4},
                                    {"async_scheduling": True}],
                         ids=["single-step", "multi-step", "overlap"])
def test_penalties_equal_the_logit_bias_they_amount_to(engine: dict, device: str) -> None:
    """presence / frequency penalties over each request's own generated tokens, counted on the
    device as they are sampled: the same tokens as a step-by-step logit_bias reference, on
    every decode path, beside a request without them (which decodes as it does alone)."""
    llm = tiny_llm(device, **engine)
    prompts, n = [[5, 6], [7, 8, 9], [1]], 24  # tiny-moe's greedy replies to 0 and 2 repeat
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)] * 3
    base = [o.token_ids for o in llm.generate(prompts, plain)]
    penalized = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                presence_penalty=0.7, frequency_penalty=0.4),
                 plain[1],
                 SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                frequency_penalty=2.0)]
    got = [o.token_ids for o in llm.generate(prompts, penalized)]
    assert got[1] == base[1]
    assert got[0] == _reference(llm, prompts[0], 0.7, 0.4, n) != base[0]
    assert got[2] == _reference(llm, prompts[2], 0.0, 2.0, n) != base[2]


def test_counts_are_dropped_with_their_requests() -> None:
    llm = LLM("tiny-moe", device="cpu")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            presence_penalty=1.0)
    llm.generate(PROMPTS, params)
    llm.generate([[1, 2]], params)
    counts = llm.engine.runner.output_counts.counts
    assert len(counts) <= 1  # the first call's three are gone; the last may await its release


@pytest.mark.parametrize(("field", "value"), [("presence_penalty", 2.5),
                                              ("frequency_penalty", float("nan")),
                                              ("presence_penalty", True),
                                              ("repetition_penalty", 0.0),
                                              ("repetition_penalty", float("inf"))])
def test_penalties_are_validated(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a number in"):
        SamplingParams(**{field: value})


def test_penalties_in_row_chunks_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """OutputCounts.apply_ bounds its temporaries by rows (a chunk a row here): the same logits
    as in one chunk; the arithmetic is presence x (count > 0) + frequency x count."""
    import torch

    from moeserve.runner import penalties

    logits = torch.randn(3, 40)
    ids = ["a", "b", "c"]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(),
              SamplingParams(frequency_penalty=-1.0)]
    results = []
    for chunk in (1 << 27, 40):
        monkeypatch.setattr(penalties, "_CHUNK_ELEMENTS", chunk)
        counts = penalties.OutputCounts()
        out = logits.clone()
        rows = counts.apply_(out.clone(), ids, params)  # creates the zero counts
        assert rows == [0, 2]
        counts.record(ids, rows, torch.tensor([3, 5, 3]))
        counts.record(ids, rows, torch.tensor([3, 7, 9]))
        counts.apply_(out, ids, params)
        results.append(out)
    assert torch.equal(results[0], results[1])
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 0.25 * 2
    expected[2, 3] -= -1.0
    expected[2, 9] -= -1.0
    torch.testing.assert_close(results[0], expected)
    assert set(counts.counts) == {"a", "c"}
    counts.release(["a", "b"])
    assert set(counts.counts) == {"c"}


def test_repetition_penalty_scales_the_prompt_and_output_tokens() -> None:
    """A repetition penalty r divides the positive and multiplies the negative logits of every
    token in the prompt or the output so far, before the frequency penalty."""
    import torch

    from moeserve.runner.penalties import OutputCounts

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = OutputCounts()
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(repetition_penalty=0.5,
                                                                     frequency_penalty=1.0)]
    counts.add_prompts(["a", "b"], [(0, [0, 1]), (1, [4])], 5, logits.device)
    rows = counts.apply_(logits.clone(), ["a", "b"], params)
    counts.record(["a", "b"], rows, torch.tensor([3, 2]))
    out = logits.clone()
    counts.apply_(out, ["a", "b"], params)
    assert out[0].tolist() == [1.0, -2.0, 0.5, 1.5, -2.0]  # prompt 0, 1 and output 3
    assert out[1].tolist() == [2.0, -1.0, 1.0 - 1.0, 3.0, -1.0]  # prompt 4, output 2 (x2 - 1)
    counts.release(["a"])
    assert set(counts.prompts) == {"b"}


def test_repetition_penalty_reaches_every_path() -> None:
    """The same tokens on the single-step, multi-step and overlap paths, unlike the unpenalized
    reply, and after a prefix-cache hit (the prompt comes to the runner with the first plan,
    hit or not); the prompt masks are dropped with their requests."""
    prompt, n = [5, 6], 24  # tiny-moe's greedy reply repeats after 18 tokens
    plain = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.8)
    base = LLM("tiny-moe", device="cpu", dtype="float32").generate([prompt], plain)[0].token_ids
    got = []
    for engine in ({}, {"num_continuous_decode_steps": 4}, {"async_scheduling": True}):
        llm = LLM("tiny-moe", device="cpu", dtype="float32", **engine)
        outs = llm.generate([prompt, prompt], [params, plain])
        assert outs[1].token_ids == base
        got.append(outs[0].token_ids)
        llm.generate([[1]], SamplingParams(max_tokens=2))  # a plan that names them finished
        assert not llm.engine.runner.output_counts.prompts
    assert all(g == got[0] for g in got) and got[0] != base
    favour = SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=0.01)
    assert llm.generate([prompt], favour)[0].token_ids[0] in prompt  # the prompt counts
    llm = LLM("tiny-moe", device="cpu", dtype="float32", enable_prefix_caching=True,
              block_size=4)
    long = [9, 8, 7, 6, 1, 2, 3, 4, 5, 6]
    first, again = (llm.generate([long], params)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 8
    assert again.token_ids == first.token_ids
