"""Scheduling for overlap: schedule() of step N+1 before update() of step N.

A request whose sampled token is in flight is scheduled with token id -1; a stop found by the
update of step N is applied one step late, and the extra token of step N+1 is discarded.
"""

from __future__ import annotations

from moeserve.sched import RequestStatus
from moeserve.types import FinishReason
from tests.sched.fakes import EOS, make_request, make_scheduler, model_output, row


def test_schedule_schedule_update_update_with_a_stop_one_step_late() -> None:
    sched = make_scheduler()
    a, b = make_request("a", 5, max_tokens=10), make_request("b", 6, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    out1 = sched.schedule()
    out2 = sched.schedule()  # before update(out1): both decodes use a placeholder
    sched.check_integrity()
    assert (row(out2, "a")["num_computed"], row(out2, "a")["token_ids"]) == (5, [-1])
    assert (row(out2, "b")["num_computed"], row(out2, "b")["token_ids"]) == (6, [-1])
    assert out2.sample == [True, True] and out2.num_output_tokens == [1, 1]
    assert a.num_output_placeholders == 2 and a.num_computed_tokens == 6

    outputs = sched.update(out1, model_output(out1, {"a": 11, "b": EOS}))
    sched.check_integrity()
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outputs] == [
        ("a", [11], False), ("b", [EOS], True)]
    assert "b" not in sched.pool.block_tables  # freed at once, with its step 2 still in flight

    out3 = sched.schedule()
    assert out3.finished_req_ids == ["b"] and out3.req_ids == ["a"]
    assert (row(out3, "a")["num_computed"], row(out3, "a")["token_ids"]) == (6, [-1])

    outputs = sched.update(out2, model_output(out2, {"a": 12, "b": 13}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [12])]
    assert b.output_token_ids == [EOS]  # the extra token is discarded
    assert b.finish_reason is FinishReason.STOP
    sched.update(out3, model_output(out3, {"a": 14}))
    sched.check_integrity()
    out4 = sched.schedule()  # back in step: the decode input is known
    assert row(out4, "a")["token_ids"] == [14] and a.output_token_ids == [11, 12, 14]
    assert a.num_output_placeholders == 1


def test_a_request_at_its_last_token_is_not_scheduled_again() -> None:
    sched = make_scheduler()
    a = make_request("a", 4, max_tokens=1)
    sched.add_request(a)
    out1 = sched.schedule()
    out2 = sched.schedule()  # a's in-flight token is its last: nothing to do
    assert out1.req_ids == ["a"] and out2.req_ids == []
    (output,) = sched.update(out1, model_output(out1, 9))
    assert output.finished and output.finish_reason is FinishReason.LENGTH
    assert sched.update(out2, model_output(out2)) == []
    assert not sched.has_unfinished_requests()


def test_a_request_at_max_model_len_is_not_scheduled_past_it() -> None:
    sched = make_scheduler(max_model_len=8)
    a = make_request("a", 7, max_tokens=5)  # one output reaches max_model_len
    sched.add_request(a)
    out1 = sched.schedule()
    assert sched.schedule().req_ids == []
    (output,) = sched.update(out1, model_output(out1, 9))
    assert output.finish_reason is FinishReason.LENGTH and a.num_tokens == 8


def test_a_preempted_request_waits_for_its_in_flight_token() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24,
                           enable_prefix_caching=False)  # 6 usable blocks
    a, b = make_request("a", 12), make_request("b", 12)
    sched.add_request(a)
    sched.add_request(b)
    out1 = sched.schedule()  # 3 blocks each
    out2 = sched.schedule()  # a needs a 4th block: b (token in flight) is preempted
    assert out2.req_ids == ["a"] and out2.preempted_req_ids == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_output_placeholders == 1
    sched.finish_requests(["a"], FinishReason.ABORT)  # plenty of room now
    out3 = sched.schedule()
    assert out3.req_ids == []  # b's last token is unknown: it cannot be recomputed yet
    outputs = sched.update(out1, model_output(out1, {"a": 20, "b": 21}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [21])]
    sched.check_integrity()
    sched.update(out2, model_output(out2))
    sched.update(out3, model_output(out3))
    out4 = sched.schedule()
    assert (row(out4, "b")["num_computed"], row(out4, "b")["token_ids"]) == (
        0, b.prompt_token_ids + [21])
    sched.check_integrity()


def test_chunked_prefill_in_flight_does_not_sample_until_its_last_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", 10)
    sched.add_request(a)
    outs = [sched.schedule() for _ in range(4)]  # chunks 4, 4, 2 (sample), then decode (-1)
    assert [(row(o, "a")["num_scheduled"], row(o, "a")["sample"]) for o in outs] == [
        (4, False), (4, False), (2, True), (1, True)]
    assert row(outs[3], "a")["token_ids"] == [-1]
    assert sched.update(outs[0], model_output(outs[0])) == []
    assert sched.update(outs[1], model_output(outs[1])) == []
    assert [o.new_token_ids for o in sched.update(outs[2], model_output(outs[2], 30))] == [[30]]
    assert [o.new_token_ids for o in sched.update(outs[3], model_output(outs[3], 31))] == [[31]]
    assert a.output_token_ids == [30, 31] and a.num_output_placeholders == 0
    sched.check_integrity()
