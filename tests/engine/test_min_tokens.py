"""SamplingParams.min_tokens through the engine: EOS and stop ids held off until a request has
generated that many tokens, on every decode path, each row by its own count."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.runner.step_sampling import hold_stops_
from moeserve.types import FinishReason
from tests.engine.conftest import tiny_llm

PATHS = pytest.mark.parametrize("engine", [{}, {"num_continuous_decode_steps": 4},
                                           {"async_scheduling": True}],
                                ids=["single-step", "multi-step", "overlap"])


@PATHS
def test_stops_wait_for_min_tokens(engine: dict, device: str) -> None:
    """A +100 bias makes EOS (or a stop id) the greedy token at every step: with min_tokens m
    the reply is m other tokens and then it (multi-step plans and overlap scheduling count the
    tokens in flight), ignore_eos keeps EOS allowed, and a request without min_tokens beside
    them stops at once."""
    llm = tiny_llm(device, **engine)
    eos = llm.engine.model_config.eos_token_ids[0]
    params = [SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5, logit_bias={eos: 100}),
              SamplingParams(max_tokens=12, temperature=0.0, min_tokens=3, stop_token_ids=(42,),
                             logit_bias={42: 100}),
              SamplingParams(max_tokens=12, temperature=0.0, logit_bias={eos: 100}),
              SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6, logit_bias={eos: 100}),
              SamplingParams(max_tokens=4, temperature=0.8, min_tokens=2, ignore_eos=True,
                             logit_bias={eos: 100})]
    outs = llm.generate([[1, 2, 3, 4], [5, 6], [7, 8, 9], [3], [4, 4]], params)
    tokens = [o.token_ids for o in outs]
    assert len(tokens[0]) == 6 and eos not in tokens[0][:5] and tokens[0][5] == eos
    assert outs[0].finish_reason is FinishReason.STOP
    assert len(tokens[1]) == 4 and 42 not in tokens[1][:3] and tokens[1][3] == 42
    assert outs[1].finish_reason is FinishReason.STOP
    assert tokens[2] == [eos]
    assert len(tokens[3]) == 6 and eos not in tokens[3]
    assert outs[3].finish_reason is FinishReason.LENGTH
    assert tokens[4] == [eos] * 4  # ignore_eos: EOS is no stop, so it is not held


def test_held_rows_equal_a_ban_by_logit_bias() -> None:
    """Greedy with min_tokens equals greedy with the stop ids biased by -100 for the first
    min_tokens steps, one token a call (tiny-moe's logits are far within 100 of each other)."""
    llm = LLM("tiny-moe", device="cpu")
    prompt, stop_id = [5, 6], None
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True))[0].token_ids
    stop_id = plain[0]  # the first greedy token: without min_tokens the reply stops at once
    got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                min_tokens=4, stop_token_ids=(stop_id,)))
    out: list[int] = []
    while len(out) < 8:
        bias = {stop_id: -100.0} if len(out) < 4 else {}
        out += llm.generate([prompt + out], SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, logit_bias=bias))[0].token_ids
        if len(out) > 4 and out[-1] == stop_id:
            break
    assert got[0].token_ids == out and stop_id not in out[:4]


def test_hold_stops_masks_only_rows_short_of_their_count() -> None:
    logits = torch.zeros(3, 10)
    params = [SamplingParams(min_tokens=2, stop_token_ids=(3,)),
              SamplingParams(min_tokens=2, stop_token_ids=(4,)),
              SamplingParams(min_tokens=5, ignore_eos=True, stop_token_ids=(5,))]
    hold_stops_(logits, params, range(3), [1, 2, 0].__getitem__, eos_token_ids=(9,))
    inf = float("-inf")
    assert logits[0].tolist() == [0, 0, 0, inf, 0, 0, 0, 0, 0, inf]
    assert logits[1].tolist() == [0.0] * 10  # its 2 tokens are out: nothing held
    assert logits[2].tolist() == [0, 0, 0, 0, 0, inf, 0, 0, 0, 0]  # EOS is no stop here


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_tokens": 17}, r"min_tokens must be an integer in \[0, max_tokens=16\]"),
    ({"min_tokens": -1}, "min_tokens must be"),
    ({"min_tokens": True}, "min_tokens must be"),
])
def test_min_tokens_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_min_tokens_with_a_grammar_is_refused() -> None:
    from moeserve.structured.spec import StructuredOutput
    with pytest.raises(ValueError, match="min_tokens cannot be combined with a structured"):
        SamplingParams(min_tokens=2, structured=StructuredOutput("regex", "a+"))


@pytest.mark.parametrize("engine", [{}, {"num_continuous_decode_steps": 4}],
                         ids=["single-step", "multi-step"])
def test_allowed_token_ids_are_all_a_row_samples(engine: dict) -> None:
    """Greedy and sampled rows pick among their allowed ids alone (the greedy one the likeliest
    of them: logprobs say so), beside a row without a list."""
    llm = LLM("tiny-moe", device="cpu", dtype="float32", **engine)
    allowed = (11, 42, 77)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                             allowed_token_ids=allowed, logprobs=3),
              SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                             allowed_token_ids=[77, 11]),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    outs = llm.generate([[5, 6], [7, 8], [5, 6]], params)
    assert set(outs[0].token_ids) <= set(allowed) and set(outs[1].token_ids) <= {11, 77}
    for lp, token in zip(outs[0].logprobs, outs[0].token_ids, strict=True):
        assert lp.top_token_ids[0] == token and set(lp.top_token_ids) <= set(allowed)
    alone = llm.generate([[5, 6]], params[2])[0].token_ids
    assert outs[2].token_ids == alone and not set(alone) <= set(allowed)


def test_allowed_token_ids_are_validated() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids must be 1 to 4096 token ids"):
        SamplingParams(allowed_token_ids=())
    llm = LLM("tiny-moe", device="cpu")
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"allowed_token_ids has token id {vocab}, outside"):
        llm.generate([[1]], SamplingParams(allowed_token_ids=[1, vocab]))


def test_allowed_ids_that_min_tokens_holds_off_are_refused() -> None:
    """allowed_token_ids that are all stop tokens under min_tokens would leave nothing to
    sample: refused by name (they failed in the sampler, non-finite logits, before)."""
    from moeserve.structured.spec import StructuredOutput

    llm = LLM("tiny-moe", device="cpu")
    eos = llm.engine.model_config.eos_token_ids[0]
    for params in (SamplingParams(allowed_token_ids=[5], stop_token_ids=(5,), min_tokens=1),
                   SamplingParams(allowed_token_ids=[eos], min_tokens=2)):
        with pytest.raises(ValueError, match="allowed_token_ids .* are all tokens that stop"):
            llm.generate([[1, 2]], params)
    ok = llm.generate([[1, 2]], SamplingParams(max_tokens=3, allowed_token_ids=[eos],
                                               min_tokens=2, ignore_eos=True))[0]
    assert ok.token_ids == [eos] * 3
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        SamplingParams(allowed_token_ids=[1], structured=StructuredOutput("regex", "a"))
    with pytest.raises(ValueError, match="must hold the reasoning budget's end token 5"):
        SamplingParams(allowed_token_ids=[1], reasoning_budget=(5, 10, -1))
    assert SamplingParams(allowed_token_ids=[1, 5], reasoning_budget=(5, 10, -1)).edits_logits
