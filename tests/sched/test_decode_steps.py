"""num_continuous_decode_steps: decode-only steps planned for several tokens back to back."""

from __future__ import annotations

import dataclasses

from moeserve.sched import Scheduler
from moeserve.types import ModelOutput, SchedulerOutput
from tests.sched.fakes import make_request, make_scheduler


def _multi(steps: int, **kw: object) -> Scheduler:
    sched = make_scheduler(**kw)
    sched.config = dataclasses.replace(sched.config, num_continuous_decode_steps=steps)
    return sched


def _output(out: SchedulerOutput, token: int = 7) -> ModelOutput:
    extra = [[token] * (out.num_steps - 1) for _ in out.req_ids] if out.num_steps > 1 else None
    return ModelOutput(sampled_token_ids=[token] * out.num_reqs, extra_token_ids=extra)


def test_only_decode_only_steps_are_extended() -> None:
    sched = _multi(4)
    sched.add_request(make_request("a", 6, max_tokens=20))
    first = sched.schedule()  # a prefill: one step
    assert first.num_steps == 1
    sched.update(first, _output(first))
    sched.add_request(make_request("b", 5, max_tokens=20))
    mixed = sched.schedule()  # a decode beside b's prefill: one step
    assert mixed.num_steps == 1
    sched.update(mixed, _output(mixed))
    decode = sched.schedule()
    assert decode.num_steps == 4 and decode.num_scheduled_tokens == [1, 1]
    outs = sched.update(decode, _output(decode))
    assert [len(o.new_token_ids) for o in outs] == [4, 4]  # one output per row, 4 tokens
    sched.check_integrity()
    a = sched.requests["a"]
    assert a.num_computed_tokens == a.num_tokens - 1 and a.num_output_placeholders == 0


def test_steps_bounded_by_max_tokens_and_stop() -> None:
    sched = _multi(8)
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("b", 4, max_tokens=30))
    out = sched.schedule()
    sched.update(out, _output(out))
    out = sched.schedule()
    assert out.num_steps == 2  # a may take only 2 more tokens (its 2nd and 3rd)
    outs = sched.update(out, _output(out))
    assert outs[0].finished and len(outs[0].new_token_ids) == 2  # a reached max_tokens
    assert len(sched.requests) == 1
    out = sched.schedule()
    assert out.num_steps == 8
    eos_at_2 = ModelOutput(sampled_token_ids=[7], extra_token_ids=[[7, 2, 7, 7, 7, 7, 7]])
    (done,) = sched.update(out, eos_at_2)
    assert done.finished and done.new_token_ids == [7, 7, 2]  # the tokens after EOS are dropped
    sched.check_integrity()
    assert sched.pool.num_free_blocks == 63


def test_no_extension_without_free_blocks_or_with_logprobs() -> None:
    sched = _multi(8, num_blocks=7, block_size=4, max_model_len=12)  # 6 usable blocks
    for rid in "abc":
        sched.add_request(make_request(rid, 5, max_tokens=30))
    out = sched.schedule()  # three prompts of 5 tokens: 2 blocks each, none left free
    sched.update(out, _output(out))
    assert sched.pool.num_free_blocks == 0
    out = sched.schedule()
    assert out.num_steps == 1  # the 6th token of each fits, more would need blocks
    sched.update(out, _output(out))
    sched.check_integrity()
    logprobs = _multi(8)
    logprobs.add_request(make_request("lp", 4, max_tokens=30, logprobs=2))
    out = logprobs.schedule()
    logprobs.update(out, _output(out))
    assert logprobs.schedule().num_steps == 1
