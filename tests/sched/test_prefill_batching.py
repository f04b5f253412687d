"""prefill_batch_delay_steps: new prompts wait a few decode-only steps to share a prefill step."""

from __future__ import annotations

import dataclasses

from moeserve.sched import Scheduler
from moeserve.types import ModelOutput, SchedulerOutput
from tests.sched.fakes import make_request, make_scheduler


def _delayed(delay: int, **kw: object) -> Scheduler:
    sched = make_scheduler(num_blocks=256, max_num_batched_tokens=64, max_model_len=64, **kw)
    sched.config = dataclasses.replace(sched.config, prefill_batch_delay_steps=delay)
    return sched


def _step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, ModelOutput(sampled_token_ids=[7] * out.num_reqs))
    return out


def _decoding(sched: Scheduler) -> None:
    sched.add_request(make_request("a", 6, max_tokens=50))
    _step(sched)  # a's prefill: a decodes from now on


def test_new_prompts_wait_the_delay_then_are_admitted_together() -> None:
    sched = _delayed(3)
    _decoding(sched)
    sched.add_request(make_request("b", 5, max_tokens=10))
    held = [_step(sched) for _ in range(3)]
    assert all(o.req_ids == ["a"] and o.num_scheduled_tokens == [1] for o in held)
    sched.add_request(make_request("c", 5, max_tokens=10))  # joins b's prefill step
    admitted = _step(sched)
    assert admitted.req_ids == ["a", "b", "c"] and admitted.num_scheduled_tokens == [1, 5, 5]
    sched.check_integrity()


def test_no_delay_admits_at_once() -> None:
    sched = _delayed(0)
    _decoding(sched)
    sched.add_request(make_request("b", 5, max_tokens=10))
    assert _step(sched).req_ids == ["a", "b"]


def test_admitted_at_once_when_nothing_runs_or_the_prompts_fill_the_step() -> None:
    idle = _delayed(5)
    idle.add_request(make_request("a", 6, max_tokens=5))
    assert _step(idle).req_ids == ["a"]  # nothing to decode: no reason to wait
    full = _delayed(5)
    _decoding(full)
    full.add_request(make_request("big", 63, max_tokens=1))  # 63 tokens fill the 63 left
    assert _step(full).req_ids == ["a", "big"]


def test_admitted_at_once_when_waiting_requests_fill_the_free_slots() -> None:
    sched = _delayed(5, max_running_requests=2)
    _decoding(sched)
    sched.add_request(make_request("b", 5, max_tokens=10))  # the one free slot
    assert _step(sched).req_ids == ["a", "b"]
