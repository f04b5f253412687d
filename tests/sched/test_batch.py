"""The running set's arrays (sched/batch.py): the vectorised step 1 and update() against the
request-by-request paths, side by side; the arrays and slots through admit, preempt, finish and
abort (check_integrity covers them); stale rows; the plan's block tables left as scheduled."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.sched import Scheduler
from moeserve.sched.batch import ONE_BY_ONE, ScheduledStep
from moeserve.sched.block_pool import cdiv
from moeserve.types import FinishReason, ModelOutput, RequestOutput, SchedulerOutput
from tests.sched.fakes import (
    EOS,
    FakeRunner,
    make_request,
    make_scheduler,
    model_output,
    row,
    step,
)

PLAN_FIELDS = [f.name for f in dataclasses.fields(SchedulerOutput)]


class OneByOne(Scheduler):
    """The reference: step 1 and update() request by request, as before the arrays."""

    def _schedule_running(self, out: ScheduledStep, budget: int) -> tuple[int, np.ndarray]:
        return self._schedule_running_one_by_one(out, budget), np.zeros(0, np.intp)

    def _update_rows(self, out: ScheduledStep, model_out: ModelOutput,
                     outputs: list[RequestOutput], finished: list) -> None:
        for i in range(out.num_reqs):
            self._update_row(out, model_out, i, outputs, finished)


def _pair(**kw: object) -> tuple[Scheduler, Scheduler]:
    fast = make_scheduler(**kw)
    ref = make_scheduler(**kw)
    ref.__class__ = OneByOne
    return fast, ref


def _sampler(vocab: int, eos_every: int):
    """Tokens from (request, position) alone, so both schedulers see the same ones."""
    counts: dict[str, int] = {}

    def sample(req_id: str) -> int:
        n = counts[req_id] = counts.get(req_id, 0) + 1
        h = hash((req_id, n)) & 0xFFFF
        return EOS if eos_every and h % eos_every == 0 else 3 + h % (vocab - 3)
    return sample


def _same_plan(a: SchedulerOutput, b: SchedulerOutput) -> None:
    for name in PLAN_FIELDS:
        assert getattr(a, name) == getattr(b, name), (
            f"{name}: {getattr(a, name)} != {getattr(b, name)}")


def _same_outputs(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    assert [dataclasses.astuple(o) for o in a] == [dataclasses.astuple(o) for o in b]


arrive = st.tuples(st.just("arrive"), st.integers(1, 4), st.integers(1, 20), st.integers(1, 12),
                   st.booleans(), st.booleans(), st.booleans())
ops = st.lists(st.one_of(arrive, arrive, st.tuples(st.just("step"), st.integers(1, 4)),
                         st.tuples(st.just("abort"), st.integers(0, 100))),
               min_size=6, max_size=30)


@settings(max_examples=120, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 6),
       budget=st.sampled_from([3, 8, 32]), max_running=st.sampled_from([1, 3, 8]),
       prefix_caching=st.booleans(), chunked=st.booleans(), overlap=st.booleans(),
       eos_every=st.sampled_from([0, 5]), delay=st.sampled_from([0, 2]), ops=ops)
def test_arrays_plan_and_update_as_request_by_request(
        block_size: int, extra_blocks: int, budget: int, max_running: int, prefix_caching: bool,
        chunked: bool, overlap: bool, eos_every: int, delay: int, ops: list[tuple]) -> None:
    max_model_len = 24
    if not chunked:
        budget = max(budget, max_model_len)
    num_blocks = cdiv(max_model_len, block_size) + 1 + extra_blocks  # tight: preemptions
    pair = _pair(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                 max_running_requests=max_running, enable_prefix_caching=prefix_caching,
                 enable_chunked_prefill=chunked, max_model_len=max_model_len)
    for sched in pair:
        sched.config = dataclasses.replace(sched.config, prefill_batch_delay_steps=delay)
    runners = [FakeRunner(block_size, _sampler(9, eos_every)) for _ in pair]
    in_flight: list[list[tuple[SchedulerOutput, ModelOutput]]] = [[], []]
    names: list[str] = []

    def step_both() -> None:
        plans = [s.schedule() for s in pair]
        _same_plan(*plans)
        outputs = []
        for k, (sched, runner) in enumerate(zip(pair, runners)):
            sched.check_integrity()
            in_flight[k].append((plans[k], runner.execute(plans[k])))
            if len(in_flight[k]) > overlap:
                outputs.append(sched.update(*in_flight[k].pop(0)))
                sched.check_integrity()
        if outputs:
            _same_outputs(*outputs)

    for op in ops:
        if op[0] == "arrive":
            _, count, length, max_tokens, ignore_eos, stop, shared = op
            for i in range(count):  # a burst: shared prompts hit the prefix cache
                name = f"r{len(names)}"
                names.append(name)
                prompt = [5, 6, 7, 8] * 6 if shared else [100 * len(names) + j for j in range(24)]
                for sched, runner in zip(pair, runners):
                    req = make_request(name, prompt[:max(length - i, 1)], max_tokens=max_tokens,
                                       ignore_eos=ignore_eos, stop_token_ids=(4,) if stop else ())
                    runner.add(req)
                    sched.add_request(req)
        elif op[0] == "step":
            for _ in range(op[1]):
                step_both()
        elif names:
            for sched in pair:
                sched.finish_requests([names[op[1] % len(names)]], FinishReason.ABORT)
                sched.check_integrity()
    for _ in range(300):
        if not pair[0].has_unfinished_requests():
            break
        step_both()
    assert not pair[1].has_unfinished_requests()
    for k, sched in enumerate(pair):
        while in_flight[k]:
            sched.update(*in_flight[k].pop(0))
        assert sched.pool.num_free_blocks == num_blocks - 1
        assert sched.batch.num_free_slots == max_running and not sched.batch.stop_counts


def test_check_integrity_catches_a_stale_array() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    out = sched.schedule()
    sched.update(out, model_output(out))
    sched.check_integrity()
    a = sched.requests["a"]
    sched.batch.num_computed[a.slot] += 1  # behind the scheduler's back
    with pytest.raises(AssertionError, match="arrays"):
        sched.check_integrity()


def test_slots_and_stop_counts_through_admit_preempt_finish_abort() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24, max_running_requests=3,
                           enable_prefix_caching=False)  # 6 usable blocks
    a = make_request("a", 11, max_tokens=10)
    b = make_request("b", 11, max_tokens=10, stop_token_ids=(9,))
    c = make_request("c", 3, max_tokens=10, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = step(sched, {"a": 20, "b": 21})  # a and b admitted (3 blocks each); c waits
    assert out.req_ids == ["a", "b"] and (a.slot, b.slot, c.slot) == (0, 1, -1)
    assert sched.batch.stop_counts == {EOS: 2, 9: 1}
    step(sched, {"a": 20, "b": 21})  # their 12th tokens still fit
    out = sched.schedule()  # a's 13th needs a 4th block: b, the last, is preempted
    assert out.preempted_req_ids == ["b"] and b.slot == -1
    assert sched.batch.stop_counts == {EOS: 1} and sched.batch.num_free_slots == 2
    sched.check_integrity()
    sched.update(out, model_output(out, {"a": 22}))
    sched.finish_requests(["a"], FinishReason.ABORT)  # b and c come back
    assert sched.batch.generation[0] == 1 and sched.batch.num_free_slots == 3
    out = sched.schedule()
    assert out.req_ids == ["b", "c"] and (b.slot, c.slot) == (0, 1)
    assert sched.batch.stop_counts == {EOS: 1, 9: 1}  # c ignores EOS
    sched.check_integrity()
    sched.update(out, model_output(out, {"b": 9, "c": 9}))  # b's stop id: c goes on
    assert b.finish_reason is FinishReason.STOP and not c.is_finished
    assert sched.batch.stop_counts == {} and c.output_token_ids == [9]
    sched.check_integrity()


def test_a_stale_row_leaves_the_slots_new_owner_alone() -> None:
    sched = make_scheduler(max_running_requests=1)
    a, b = make_request("a", 4, max_tokens=10), make_request("b", 4, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    out1 = sched.schedule()
    sched.finish_requests(["a"], FinishReason.ABORT)  # its row of out1 is in flight
    out2 = sched.schedule()  # b takes a's slot
    assert out2.req_ids == ["b"] and b.slot == 0 and sched.batch.generation[0] == 1
    assert sched.update(out1, model_output(out1, 11)) == []  # a's token is discarded
    assert b.output_token_ids == [] and b.num_output_placeholders == 1
    (o,) = sched.update(out2, model_output(out2, 12))
    assert (o.request_id, o.new_token_ids) == ("b", [12]) and b.output_token_ids == [12]
    sched.check_integrity()


def test_rows_sorted_for_update() -> None:
    sched = make_scheduler(block_size=4, max_model_len=16)
    for name, prompt in (("a", 3), ("b", 5), ("c", 4), ("d", 14)):
        sched.add_request(make_request(name, prompt, max_tokens=8))
    out = sched.schedule()
    sched.update(out, model_output(out))
    out = sched.schedule()  # decodes at positions 3, 5, 4 and 14
    codes, tokens = sched.batch.classify(out, model_output(out, {"b": EOS}), 4)
    # a fills its first block (cache it), b samples EOS, c just appends, d reaches max_model_len
    assert codes == [2, ONE_BY_ONE, 1, ONE_BY_ONE] and tokens == [[7], [EOS], [7], [7]]


def test_a_plans_block_tables_stay_as_scheduled() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", 4, max_tokens=10))
    out1 = sched.schedule()
    sched.update(out1, model_output(out1))
    out2 = sched.schedule()  # position 4: a second block
    assert row(out1, "a")["block_table"] == row(out2, "a")["block_table"][:1]
    assert len(row(out1, "a")["block_table"]) == 1 and len(row(out2, "a")["block_table"]) == 2
