"""Random arrive / step / abort sequences over a tight KV cache, synchronous and overlapped.

A fake runner keeps a fake paged KV cache and checks, every step, that each row sees exactly its
own tokens at every position (block tables, prefix hits, preemption and placeholders end to end);
check_integrity() runs after every schedule and update. At the end every request has finished,
for a reason its tokens justify, and all blocks are free again.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.sched import Request, Scheduler
from moeserve.sched.block_pool import cdiv
from moeserve.types import FinishReason, ModelOutput, RequestOutput, SchedulerOutput
from tests.sched.fakes import EOS, FakeRunner, make_request, make_scheduler, random_sampler

STOP_TOKEN = 5
# Prompts are prefixes of these (with their last token varied), so prefix hits are common.
_rng = random.Random(0)
BASE_PROMPTS = [[_rng.randrange(3, 7) for _ in range(23)] for _ in range(3)]


class Harness:
    """Drives the scheduler like the engine: synchronously, or one step in flight (overlap)."""

    def __init__(self, sched: Scheduler, runner: FakeRunner, overlap: bool) -> None:
        self.sched, self.runner, self.overlap = sched, runner, overlap
        self.in_flight: deque[tuple[SchedulerOutput, ModelOutput]] = deque()
        self.reqs: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}  # what the outputs reported, per request
        self.finished: dict[str, RequestOutput] = {}
        self.aborted: set[str] = set()

    def add(self, req: Request) -> None:
        self.reqs[req.request_id] = req
        self.tokens[req.request_id] = []
        self.runner.add(req)
        self.sched.add_request(req)

    def abort(self, req_id: str) -> None:
        if self.sched.has_request(req_id):
            self.aborted.add(req_id)
        self.sched.finish_requests([req_id], FinishReason.ABORT)
        self.sched.check_integrity()

    def step(self) -> None:
        out = self.sched.schedule()
        self.sched.check_integrity()
        if not self.overlap:
            assert -1 not in out.token_ids
        self.in_flight.append((out, self.runner.execute(out)))
        if len(self.in_flight) > (1 if self.overlap else 0):
            self._update(*self.in_flight.popleft())

    def flush(self) -> None:
        while self.in_flight:
            self._update(*self.in_flight.popleft())

    def _update(self, out: SchedulerOutput, model_out: ModelOutput) -> None:
        for o in self.sched.update(out, model_out):
            assert o.request_id not in self.finished, "output after the request finished"
            self.tokens[o.request_id] += o.new_token_ids
            if o.finished:
                self.finished[o.request_id] = o
        self.sched.check_integrity()


arrive = st.tuples(st.just("arrive"), st.integers(1, 4), st.integers(0, 2), st.integers(1, 23),
                   st.integers(3, 6), st.integers(1, 12), st.booleans(), st.booleans())
ops = st.lists(st.one_of(arrive, arrive, arrive, st.tuples(st.just("step"), st.integers(1, 4)),
                         st.tuples(st.just("abort"), st.integers(0, 100))),
               min_size=8, max_size=40)


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), extra_blocks=st.integers(0, 4),
       budget=st.sampled_from([3, 8, 32]), max_running=st.sampled_from([1, 2, 4, 8]),
       prefix_caching=st.booleans(), chunked=st.booleans(), watermark=st.sampled_from([0, 0.1]),
       overlap=st.booleans(), eos_prob=st.sampled_from([0.0, 0.2]), ops=ops,
       delay=st.sampled_from([0, 0, 3]), rng=st.randoms(use_true_random=False))
def test_random_sequences_keep_integrity_and_finish(
        block_size: int, extra_blocks: int, budget: int, max_running: int,
        prefix_caching: bool, chunked: bool, watermark: float, overlap: bool, eos_prob: float,
        ops: list[tuple], delay: int, rng: random.Random) -> None:
    max_model_len = 24
    if not chunked:
        budget = max(budget, max_model_len)
    num_blocks = cdiv(max_model_len, block_size) + 1 + extra_blocks  # tight: preemptions
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_batched_tokens=budget, max_running_requests=max_running,
                           enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked,
                           watermark=watermark, max_model_len=max_model_len)
    sched.config = dataclasses.replace(sched.config, prefill_batch_delay_steps=delay)
    h = Harness(sched, FakeRunner(block_size, random_sampler(rng, 7, eos_prob)), overlap)
    for op in ops:
        if op[0] == "arrive":
            _, count, base, length, last, max_tokens, ignore_eos, stop_token = op
            for i in range(count):  # a burst: similar requests, some sharing a prefix
                prompt = BASE_PROMPTS[(base + i) % 3][:max(length - 3 * i, 1) - 1] + [last]
                h.add(make_request(f"r{len(h.reqs)}", prompt, max_tokens=max_tokens + i,
                                   ignore_eos=ignore_eos,
                                   stop_token_ids=(STOP_TOKEN,) if stop_token else ()))
        elif op[0] == "step":
            for _ in range(op[1]):
                h.step()
        elif h.reqs:
            h.abort(f"r{op[1] % len(h.reqs)}")
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        h.step()
    h.flush()
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    assert sched.pool.num_free_blocks == num_blocks - 1 and sched.stats.kv_usage == 0.0
    for req_id, req in h.reqs.items():
        _check_finished(h, req_id, req, max_model_len)


def _check_finished(h: Harness, req_id: str, req: Request, max_model_len: int) -> None:
    params, tokens = req.sampling_params, req.output_token_ids
    assert req.is_finished and h.tokens[req_id] == tokens
    assert len(tokens) <= params.max_tokens and req.num_tokens <= max_model_len
    assert h.runner.truth[req_id][req.num_prompt_tokens:][:len(tokens)] == tokens
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    assert not stops & set(tokens[:-1]), f"{req_id} went on past a stop token: {tokens}"
    if req_id in h.aborted:
        assert req.finish_reason is FinishReason.ABORT and req_id not in h.finished
        return
    assert h.finished[req_id].finish_reason is req.finish_reason
    if req.finish_reason is FinishReason.STOP:
        assert tokens[-1] in stops
        assert req.stop_reason == (tokens[-1] if tokens[-1] != EOS or params.ignore_eos else None)
    else:
        assert req.finish_reason is FinishReason.LENGTH and tokens[-1] not in stops
        assert len(tokens) == params.max_tokens or req.num_tokens == max_model_len
