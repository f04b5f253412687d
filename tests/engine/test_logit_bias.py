"""SamplingParams.logit_bias through the engine: every decode path applies it, to its own row."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("engine", [{}, {"num_continuous_decode_steps": 4},
                                    {"async_scheduling": True}],
                         ids=["single-step", "multi-step", "overlap"])
def test_each_row_gets_its_own_bias(engine: dict) -> None:
    """A +100 bias forces its token at every step of its request (multi-step decode plans and
    overlap scheduling included), a -100 bias keeps the greedy token out, and the request
    without a bias decodes as it does alone."""
    llm = LLM("tiny-moe", device="cpu", **engine)
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
