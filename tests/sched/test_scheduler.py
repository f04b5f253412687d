"""Scheduler, synchronous loop: batching order, token budget, chunked prefill, prefix hits,
preemption, abort, stop conditions, the running cap, the watermark and LRU eviction."""

from __future__ import annotations

import pytest

from moeserve.config import ConfigError
from moeserve.sched import RequestStatus
from moeserve.types import FinishReason, Logprobs, ModelOutput
from tests.sched.fakes import EOS, make_request, make_scheduler, row, step


def test_continuous_batching_keeps_order_and_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=25)
    reqs = [make_request(name, 10, max_tokens=4) for name in "abc"]
    for r in reqs:
        sched.add_request(r)
    out, outputs = step(sched, {"a": 11, "b": 12})
    assert out.req_ids == ["a", "b", "c"]
    assert out.num_scheduled_tokens == [10, 10, 5] and out.sample == [True, True, False]
    assert [o.request_id for o in outputs] == ["a", "b"]  # c's chunk sampled nothing
    sched.add_request(make_request("d", 10))
    out, _ = step(sched)
    assert out.req_ids == ["a", "b", "c", "d"]  # running first, in order, then the newcomer
    assert out.num_scheduled_tokens == [1, 1, 5, 10] and sum(out.num_scheduled_tokens) <= 25
    assert out.num_computed_tokens == [10, 10, 5, 0]
    assert row(out, "a")["token_ids"] == [11] and row(out, "b")["token_ids"] == [12]
    assert out.sampling_params == [r.sampling_params for r in reqs] + [sched.requests["d"]
                                                                      .sampling_params]
    assert sched.stats.num_scheduled_steps == 2


def test_budget_stops_decodes_too() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    for name in "abcdefghij":
        sched.add_request(make_request(name, 1, max_tokens=5))
    out, _ = step(sched)
    assert out.req_ids == list("abcdefgh") and sched.num_waiting == 2
    out, _ = step(sched)
    assert out.req_ids == list("abcdefgh")  # the 8 running decodes use the whole budget


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    req = make_request("a", 23, max_tokens=2)
    sched.add_request(req)
    rows = []
    for _ in range(3):
        out, outputs = step(sched, 42)
        rows.append(row(out, "a"))
    assert [(r["num_computed"], r["num_scheduled"], r["sample"]) for r in rows] == [
        (0, 8, False), (8, 8, False), (16, 7, True)]
    assert [t for r in rows for t in r["token_ids"]] == req.prompt_token_ids
    assert [o.new_token_ids for o in outputs] == [[42]]
    assert sched.stats.num_prefill_chunks == 2
    out, outputs = step(sched, 43)
    assert row(out, "a")["num_computed"] == 23 and row(out, "a")["token_ids"] == [42]
    assert outputs[0].finished and req.output_token_ids == [42, 43]


def test_without_chunked_prefill_a_prompt_waits_for_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16,
                           enable_chunked_prefill=False)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    out, _ = step(sched)
    assert out.req_ids == ["a"] and sched.num_waiting == 1
    out, _ = step(sched)
    assert out.req_ids == ["a", "b"] and out.num_scheduled_tokens == [1, 10]
    assert sched.stats.num_prefill_chunks == 0
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_kv_cache_too_small_for_max_model_len_is_an_error() -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        make_scheduler(num_blocks=4, block_size=4, max_model_len=16)  # 3 usable blocks


def test_prefix_hit_shares_the_first_blocks() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 110))
    sched.add_request(make_request("a", prompt, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", prompt[:8] + [7, 7, 7], max_tokens=5))
    out, outputs = step(sched)
    b = row(out, "b")
    assert (b["num_computed"], b["num_scheduled"], b["token_ids"]) == (8, 3, [7, 7, 7])
    assert out.num_prefix_hit_tokens == 8 and sched.stats.num_prefix_hit_tokens == 8
    shared = row(out, "a")["block_table"][:2]
    assert b["block_table"][:2] == shared
    assert [sched.pool.ref_count(x) for x in shared] == [2, 2]
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 8}


def test_full_prompt_hit_leaves_one_token_to_compute() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(200, 209))  # 2 full blocks + 1 token
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)  # a finishes; its blocks stay cached in the free queue
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("b", prompt))
    out, _ = step(sched)
    assert (row(out, "b")["num_computed"], row(out, "b")["num_scheduled"]) == (8, 1)
    assert row(out, "b")["sample"] and row(out, "b")["token_ids"] == [prompt[8]]
    sched.add_request(make_request("c", prompt[:8]))  # whole prompt cached: last block recomputed
    out, _ = step(sched)
    assert (row(out, "c")["num_computed"], row(out, "c")["num_scheduled"]) == (4, 4)


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24,
                           enable_prefix_caching=False)  # 6 usable blocks
    a, b = make_request("a", 11, max_tokens=10), make_request("b", 11, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    for k in range(2):  # prefill (3 blocks each), then one decode that still fits
        out, _ = step(sched, {"a": 100 + k, "b": 200 + k})
        assert out.req_ids == ["a", "b"]
    out, _ = step(sched, {"a": 102})  # a needs a 4th block: the last running request goes
    assert out.req_ids == ["a"] and out.preempted_req_ids == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [200, 201] and "b" not in sched.pool.block_tables
    assert sched.waiting[0] is b and sched.stats.num_preemptions == 1 and b.num_preemptions == 1
    for k in range(3, 10):  # b cannot come back while a holds 4-5 blocks
        out, _ = step(sched, {"a": 100 + k})
        assert out.req_ids == ["a"]
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    out, _ = step(sched, {"b": 202})
    b_row = row(out, "b")
    assert (b_row["num_computed"], b_row["num_scheduled"], b_row["sample"]) == (0, 13, True)
    assert b_row["token_ids"] == b.prompt_token_ids + [200, 201]
    while sched.has_unfinished_requests():
        step(sched, {"b": 203})
    assert b.output_token_ids[:3] == [200, 201, 202] and len(b.output_token_ids) == 10


def test_the_last_running_request_preempts_itself_and_nobody_is_admitted() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=24, max_num_batched_tokens=8,
                           enable_prefix_caching=False)  # 6 usable blocks
    sched.add_request(make_request("a", 12))
    sched.add_request(make_request("b", 11))
    step(sched)  # a: chunk 8
    out, _ = step(sched)  # a: last chunk 4 (3 blocks); b: chunk 4 (1 block)
    assert out.req_ids == ["a", "b"] and out.num_scheduled_tokens == [4, 4]
    out, _ = step(sched)  # a takes a 4th block; b's next chunk needs 2 blocks, 1 is free
    assert out.req_ids == ["a"] and out.preempted_req_ids == ["b"]
    # b's blocks came back: 2 free and 7 tokens of budget would admit a 7-token chunk of b,
    # but a step that preempts admits no one (it would only thrash).
    assert sched.pool.num_free_blocks == 2 and [r.request_id for r in sched.waiting] == ["b"]
    out, _ = step(sched)
    assert out.req_ids == ["a", "b"] and row(out, "b")["num_scheduled"] == 7


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler(max_running_requests=2)
    for name in "abc":
        sched.add_request(make_request(name, 10))
    out = sched.schedule()
    free_before = sched.pool.num_free_blocks
    sched.finish_requests(["a"], FinishReason.ABORT)
    sched.check_integrity()
    assert sched.pool.num_free_blocks == free_before + 3 and not sched.has_request("a")
    outputs = sched.update(out, ModelOutput([5, 6]))  # a's in-flight row is discarded
    assert [o.request_id for o in outputs] == ["b"]
    sched.finish_requests(["a", "unknown", "c"], FinishReason.ABORT)  # c was waiting
    sched.check_integrity()
    assert sched.num_waiting == 0 and sched.num_running == 1 and sched.stats.num_aborted == 2
    out = sched.schedule()
    assert out.finished_req_ids == ["a", "c"] and out.req_ids == ["b"]
    assert sched.schedule().finished_req_ids == []


def test_stop_string_found_by_engine_finishes_with_stop() -> None:
    sched = make_scheduler()
    req = make_request("a", 4)
    sched.add_request(req)
    step(sched)
    sched.finish_requests(["a"], FinishReason.STOP)
    assert req.finish_reason is FinishReason.STOP and sched.stats.num_aborted == 0
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1


@pytest.mark.parametrize("case", ["eos", "eos_list", "stop_token", "max_tokens", "max_model_len",
                                  "ignore_eos", "eos_at_max_tokens"])
def test_stop_conditions(case: str) -> None:
    sched = make_scheduler(max_model_len=16)
    kwargs: dict = {}
    tokens, prompt, max_tokens = [5, EOS, 5], 4, 8
    expect = (2, FinishReason.STOP, None)  # (number of outputs, reason, stop_reason)
    if case == "eos_list":
        kwargs["eos_token_ids"], tokens = (EOS, 3), [5, 3, 5]
    elif case == "stop_token":
        kwargs["stop_token_ids"], tokens, expect = (9,), [5, 9, 5], (2, FinishReason.STOP, 9)
    elif case == "max_tokens":
        tokens, max_tokens, expect = [5, 5, 5, 5], 3, (3, FinishReason.LENGTH, None)
    elif case == "max_model_len":
        tokens, prompt, expect = [5, 5, 5, 5], 14, (2, FinishReason.LENGTH, None)
    elif case == "ignore_eos":
        kwargs["ignore_eos"], tokens, max_tokens = True, [EOS] * 4, 3
        expect = (3, FinishReason.LENGTH, None)
    elif case == "eos_at_max_tokens":
        max_tokens = 2  # EOS is also the max_tokens-th token: the stop token wins
    req = make_request("a", prompt, max_tokens=max_tokens, **kwargs)
    sched.add_request(req)
    outputs = []
    for tok in tokens:
        if not sched.has_unfinished_requests():
            break
        outputs += step(sched, tok)[1]
    num, reason, stop_reason = expect
    assert req.output_token_ids == tokens[:num]  # the stop token stays in the output
    assert [o.finished for o in outputs] == [False] * (num - 1) + [True]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (reason, stop_reason)
    assert req.status is RequestStatus.FINISHED
    assert sched.pool.num_free_blocks == sched.pool.num_blocks - 1  # freed at once


def test_max_running_requests_is_honoured() -> None:
    sched = make_scheduler(max_running_requests=2)
    sched.add_request(make_request("a", 3, max_tokens=1))
    for name in "bcd":
        sched.add_request(make_request(name, 3, max_tokens=5))
    out, _ = step(sched)
    assert out.req_ids == ["a", "b"] and sched.num_waiting == 2
    out, _ = step(sched)  # a finished: one seat
    assert out.req_ids == ["b", "c"] and sched.num_running == 2 and sched.num_waiting == 1


def test_fifo_admission_without_overtaking() -> None:
    sched = make_scheduler(num_blocks=9, block_size=4, max_model_len=32)  # 8 usable blocks
    sched.add_request(make_request("a", 20))  # 5 blocks
    sched.add_request(make_request("b", 16))  # 4 blocks: does not fit
    sched.add_request(make_request("c", 4))  # 1 block would fit, but b is first
    out, _ = step(sched)
    assert out.req_ids == ["a"] and [r.request_id for r in sched.waiting] == ["b", "c"]


def test_watermark_keeps_blocks_free_at_admission() -> None:
    sched = make_scheduler(num_blocks=20, block_size=4, watermark=0.25, max_model_len=76,
                           max_num_batched_tokens=80)  # 19 usable, watermark ceil(5) blocks
    assert sched.watermark_blocks == 5
    sched.add_request(make_request("a", 40))  # 10 blocks
    sched.add_request(make_request("b", 20))  # 5 blocks: 9 free < 5 + 5
    out, _ = step(sched)
    assert out.req_ids == ["a"] and sched.pool.num_free_blocks == 9
    sched.finish_requests(["a"], FinishReason.ABORT)
    out, _ = step(sched)
    assert out.req_ids == ["b"]


def test_watermark_does_not_block_an_idle_engine() -> None:
    sched = make_scheduler(num_blocks=20, block_size=4, watermark=0.25, max_model_len=76,
                           max_num_batched_tokens=80)
    sched.add_request(make_request("a", 70))  # 18 blocks of 19, nothing else running
    out, _ = step(sched)
    assert out.req_ids == ["a"]


def test_lru_evicts_the_last_blocks_of_a_freed_request_first() -> None:
    sched = make_scheduler(num_blocks=9, block_size=4, max_model_len=32)  # 8 usable blocks
    prompt = list(range(300, 309))  # blocks a0, a1 full (cached), a2 partial
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    # free queue: 5 never-used blocks, then a's blocks last first: a2, a1, a0
    sched.add_request(make_request("x", 28, max_tokens=1))  # 7 blocks: evicts a2 and a1
    step(sched)
    sched.add_request(make_request("c", prompt))
    out, _ = step(sched)
    assert out.num_prefix_hit_tokens == 4 and row(out, "c")["num_computed"] == 4


def test_outputs_carry_logprobs_and_prompt() -> None:
    sched = make_scheduler()
    req = make_request("a", [5, 6, 7], logprobs=1)
    sched.add_request(req)
    out = sched.schedule()
    lp = Logprobs(token_logprob=-0.5, top_token_ids=[9], top_logprobs=[-0.5])
    (output,) = sched.update(out, ModelOutput([9], logprobs=[lp]))
    assert (output.request_id, output.prompt_token_ids, output.new_token_ids) == (
        "a", [5, 6, 7], [9])
    assert output.logprobs == [lp] and not output.finished
    assert out.sample_seeds == [req.seed] and out.num_output_tokens == [0]
    out = sched.schedule()
    assert out.num_output_tokens == [1]
    assert sched.update(out, ModelOutput([9]))[0].logprobs is None


def test_duplicate_request_id_is_rejected() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 3))


def test_kv_usage_and_step_counters() -> None:
    sched = make_scheduler(num_blocks=11, block_size=4, max_model_len=32)  # 10 usable
    assert sched.schedule().req_ids == [] and sched.stats.num_scheduled_steps == 0
    sched.add_request(make_request("a", 8, max_tokens=2))
    step(sched)
    assert sched.stats.kv_usage == pytest.approx(0.2)
    step(sched)  # a finished, blocks freed
    assert sched.stats.kv_usage == 0.0 and sched.stats.num_scheduled_steps == 2


def test_check_integrity_catches_missing_blocks() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 9))
    step(sched)
    sched.pool.free(sched.requests["a"])  # blocks gone behind the scheduler's back
    with pytest.raises(AssertionError, match="block tables"):
        sched.check_integrity()
