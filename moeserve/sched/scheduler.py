"""Continuous batching by token budget (vLLM v1 style): what runs each step, and what it produced.

The engine's loop is `out = scheduler.schedule(); result = runner.execute(out);
scheduler.update(out, result)`. Each request's `num_computed_tokens` catches up with its tokens,
one chunk per step, so prefill, chunked prefill, prefix-cache hits and decode are one mechanism:

    schedule()  1. RUNNING requests in order: a decode needs 1 token, a prefill in progress its
                   remaining tokens (capped by the budget when chunked prefill is on). When blocks
                   run out, preempt the LAST running request (free its blocks, recompute later,
                   front of the waiting queue) and retry.
                2. WAITING requests in FIFO order (none if step 1 preempted): prefix-cache lookup,
                   admit while the running cap, the budget and the free blocks (+ watermark) allow;
                   stop at the first that does not fit (no overtaking). With
                   prefill_batch_delay_steps > 0, admission may be held for that many steps
                   while requests decode, so new prompts share one (eager) prefill step.
                3. num_continuous_decode_steps > 1 and a decode-only plan: extend it to run
                   several tokens back to back, if every row can take them and blocks allow.
                -> SchedulerOutput; num_computed_tokens advances now, optimistically.
    update()    append each sampled token, apply the stop conditions, free finished requests'
                blocks at once, enter newly full blocks into the prefix cache.

Vectorised bookkeeping: the running requests' counters are mirrored in numpy arrays, a slot per
request (sched/batch.py). Step 1 is array ops over the running set (token counts, budget, the
rows that cross into a new block, which alone allocate) unless blocks run out: then it goes
request by request and preempts. update() sorts its rows with array ops: one that sampled, holds
its slot and whose tokens stop nothing just appends them; stops, errors, prefill chunks and rows
preempted or finished since go one by one. Requests stay the truth; check_integrity() checks.

Overlap: schedule() for step N+1 may run before update() of step N. A request whose sampled token
is still in flight counts it as a placeholder (`num_output_placeholders`); its next decode is
scheduled with token id -1 (the runner takes it from step N's output on the device). A stop is then
applied one step late: update() of step N+1 finds the request already finished and discards its
extra token. A preempted request is not re-admitted while a token of it is in flight.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable

import numpy as np

from moeserve.config import ConfigError, SchedulerConfig
from moeserve.sched.batch import APPEND_AND_CACHE, ONE_BY_ONE, RunningBatch, ScheduledStep
from moeserve.sched.block_pool import BlockPool, cdiv
from moeserve.sched.integrity import check_scheduler
from moeserve.sched.penalty_prompts import PenaltyPrompts
from moeserve.sched.prompt_logprobs import PromptLogprobs
from moeserve.sched.request import Request, RequestStatus
from moeserve.sched.stats import SchedulerStats
from moeserve.types import FinishReason, Logprobs, ModelOutput, RequestOutput, SchedulerOutput


class Scheduler:
    """Plans each step over a paged KV cache of `num_blocks` blocks of `block_size` tokens.

    Request ids must be unique among the requests the scheduler and in-flight steps know.
    """

    def __init__(self, scheduler_config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_running_requests: int, enable_prefix_caching: bool) -> None:
        self.config = scheduler_config
        self.max_model_len = int(scheduler_config.max_model_len)
        self.max_running_requests = max_running_requests
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.watermark_blocks = math.ceil(scheduler_config.watermark * num_blocks)
        self.stats = SchedulerStats()
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []  # freed since the last schedule()
        self._held_steps = 0  # steps admission has been held (prefill_batch_delay_steps)
        self.prompt_logprobs = PromptLogprobs()  # the requests that asked for them
        self.penalty_prompts = PenaltyPrompts()  # repetition penalties' prompts, until sent
        self._check_config(num_blocks, block_size)
        self.batch = RunningBatch(max_running_requests, self.max_model_len)
        self._running_slots: np.ndarray | None = None  # [num_running], cached until it changes

    def _check_config(self, num_blocks: int, block_size: int) -> None:
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if cdiv(self.max_model_len, block_size) > num_blocks - 1:
            raise ConfigError(
                f"the KV cache ({num_blocks - 1} usable blocks of {block_size} tokens) cannot hold "
                f"one request of max_model_len={self.max_model_len} tokens; lower max_model_len "
                "or give the KV cache more memory")
        if (not self.config.enable_chunked_prefill
                and self.config.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}), or a long prompt could never be scheduled")

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_request(self, req_id: str) -> bool:
        """True while the request is waiting or running (not yet finished)."""
        return req_id in self.requests

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a validated request (FIFO)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already scheduled")
        assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.prompt_logprobs.add(req)
        self.penalty_prompts.add(req)

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> None:
        """Finish requests from outside (abort, a stop string); unknown ids are ignored."""
        finished = [self.requests[i] for i in dict.fromkeys(req_ids) if i in self.requests]
        self.prompt_logprobs.drop(r.request_id for r in finished)
        self.penalty_prompts.drop(r.request_id for r in finished)
        for req in finished:
            self._finish(req, reason)
            if reason is FinishReason.ABORT:
                self.stats.num_aborted += 1
            elif reason is FinishReason.ERROR:
                self.stats.num_failed += 1
        self._drop_finished(finished)
        self.stats.kv_usage = self.pool.usage

    def retry_later(self, req_ids: Iterable[str]) -> list[str]:
        """Failed steps' requests (out of device memory, no fault of theirs; none of their
        tokens will come): each running one preempted by recompute, in-flight tokens forgotten,
        blocks dropped from the prefix cache (unwritten KV). Returns the ids preempted."""
        ids = set(req_ids)
        victims = [r for r in self.running if r.request_id in ids]
        self.running = [r for r in self.running if r.request_id not in ids]
        self._running_slots, step = None, ScheduledStep()
        for req in reversed(victims):  # the first back at the front of the waiting queue
            self.pool.uncache(req)
            req.num_output_placeholders = 0
            self._preempt(req, step)
        return step.preempted_req_ids

    def fail_request(self, req_id: str, error: str) -> RequestOutput | None:
        """Finish a request with FinishReason.ERROR and `error`: its output (None: unknown)."""
        if (req := self.requests.get(req_id)) is None:
            return None
        self.pool.uncache(req)
        self.prompt_logprobs.drop([req_id])
        self._finish(req, FinishReason.ERROR)
        self.stats.num_failed += 1
        self._drop_finished([req])
        return self._make_output(req, [], None, error=error)

    # ---- schedule ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring). Rows are in batch order."""
        out = ScheduledStep(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        budget, bulk_slots = self._schedule_running(out, self.config.max_num_batched_tokens)
        extend = False
        if not out.preempted_req_ids and not self._hold_admission(out, budget):
            self._schedule_waiting(out, budget)
            extend = self.config.num_continuous_decode_steps > 1 and bool(out.req_ids)
        rest = out.row_requests[len(bulk_slots):]  # rows added one by one
        out.row_slots = np.concatenate(
            [bulk_slots, np.fromiter((r.slot for r in rest), np.intp, len(rest))])
        if extend:
            self._extend_decode_steps(out)
        out.row_generations = self.batch.generation[out.row_slots]
        self.prompt_logprobs.plan(out)
        self.penalty_prompts.plan(out)
        if out.req_ids:
            self.stats.num_scheduled_steps += 1
        self.stats.kv_usage = self.pool.usage
        return out

    def _slots(self) -> np.ndarray:
        """The running requests' slots in running order (cached until `running` changes)."""
        if self._running_slots is None:
            self._running_slots = np.fromiter((r.slot for r in self.running), np.intp,
                                              len(self.running))
        return self._running_slots

    def _schedule_running(self, out: ScheduledStep, budget: int) -> tuple[int, np.ndarray]:
        """Schedule RUNNING requests in order: with array ops over the running set, or request
        by request (`_schedule_running_one_by_one`, which preempts) when the blocks they need do
        not all fit. Returns the budget left and the slots of the rows scheduled at once."""
        none = np.zeros(0, np.intp)
        rows = (self.batch.plan_running(self._slots(), budget, self.pool.block_size)
                if self.running and budget > 0 else None)
        if rows is None:
            return budget, none
        grow = np.flatnonzero(rows.missing > 0)  # the rows that cross into a new block
        if rows.missing[grow].sum() > self.pool.num_free_blocks:
            return self._schedule_running_one_by_one(out, budget), none
        reqs = (self.running[:] if len(rows.index) == len(self.running)
                else [self.running[i] for i in rows.index.tolist()])
        for j in grow.tolist():
            allocated = self.pool.allocate_slots(reqs[j], int(rows.num_new[j]))
            assert allocated is not None  # the free blocks were counted above
        self.batch.num_blocks[rows.slots[grow]] += rows.missing[grow]
        self.stats.num_prefill_chunks += self.batch.add_rows(out, reqs, rows,
                                                             self.pool.block_tables)
        return budget - int(rows.num_new.sum()), rows.slots

    def _schedule_running_one_by_one(self, out: ScheduledStep, budget: int) -> int:
        """Schedule RUNNING requests in order, preempting the last when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_new_tokens(req, budget)
            if num_new > 0:
                if not self._allocate_or_preempt(req, num_new, out):
                    break  # it was the last running request: preempted itself
                self._add_row(out, req, num_new)
                budget -= num_new
            i += 1
        return budget

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens to compute for a running request this step (0: skip it this step)."""
        num_outputs = len(req.output_token_ids) + req.num_output_placeholders
        num_tokens = len(req.prompt_token_ids) + num_outputs  # known + in flight
        if num_outputs >= req.sampling_params.max_tokens or num_tokens >= self.max_model_len:
            return 0  # its in-flight token is its last: update() will finish it
        # Only a prefill in progress can exceed the budget, and only with chunked prefill on:
        # without it a prompt is admitted whole, and running requests then decode 1 token.
        return min(num_tokens - req.num_computed_tokens, budget)

    def _allocate_or_preempt(self, req: Request, num_new: int, out: ScheduledStep) -> bool:
        """Allocate blocks for `num_new` tokens of `req`, preempting the last running request
        until they fit. False when `req` itself had to be preempted."""
        while self.pool.allocate_slots(req, num_new) is None:
            victim = self.running.pop()
            self._running_slots = None
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: ScheduledStep) -> None:
        """Preempt by recompute: drop its KV, keep its outputs, first in line to come back."""
        self.pool.free(req)
        self.batch.release(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.append(req.request_id)

    def _hold_admission(self, out: SchedulerOutput, budget: int) -> bool:
        """prefill_batch_delay_steps: hold the waiting queue for one more decode-only step? Not
        once held long enough, nor when nothing runs, nor when the step already prefills, nor
        when the waiting prompts (or the free running slots) would fill the step anyway."""
        delay = self.config.prefill_batch_delay_steps
        if (not delay or not self.waiting or not self.running or self._held_steps >= delay
                or max(out.num_scheduled_tokens, default=0) > 1):
            self._held_steps = 0
            return False
        free_slots = self.max_running_requests - len(self.running)
        if len(self.waiting) >= free_slots:
            self._held_steps = 0
            return False
        waiting_tokens = 0
        for req in self.waiting:
            waiting_tokens += req.num_tokens - req.num_computed_tokens
            if waiting_tokens >= budget:
                self._held_steps = 0
                return False
        self._held_steps += 1
        return True

    def _schedule_waiting(self, out: ScheduledStep, budget: int) -> None:
        """Admit WAITING requests in FIFO order while they fit; stop at the first that does not."""
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token in flight: its tokens are not all known yet
            hit_blocks, num_hit = (self.pool.get_computed_blocks(req)
                                   if self.prompt_logprobs.cached_prefix_allowed(req) else ([], 0))
            num_new = req.num_tokens - num_hit
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            # The watermark keeps room for running requests to grow; with none running it
            # would only stall the queue.
            reserved = self.watermark_blocks if self.running else 0
            if self.pool.allocate_slots(req, num_new, hit_blocks, reserved) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = num_hit
            self.stats.num_prefix_hit_tokens += num_hit
            out.num_prefix_hit_tokens += num_hit
            self.running.append(req)
            self._running_slots = None
            self.batch.admit(req, self.pool)
            self._add_row(out, req, num_new)
            budget -= num_new

    def _add_row(self, out: ScheduledStep, req: Request, num_new: int) -> None:
        """Append the request's row to the step and advance its state optimistically."""
        start = req.num_computed_tokens
        end = start + num_new
        num_outputs = len(req.output_token_ids) + req.num_output_placeholders
        sample = end == len(req.prompt_token_ids) + num_outputs
        out.req_ids.append(req.request_id)
        out.num_scheduled_tokens.append(num_new)
        out.num_computed_tokens.append(start)
        out.token_ids += req.get_token_ids(start, end)
        out.block_tables.append(self.pool.block_tables[req.request_id])
        out.sample.append(sample)
        out.sampling_params.append(req.sampling_params)
        out.sample_seeds.append(req.seed)
        out.num_output_tokens.append(num_outputs)
        out.row_requests.append(req)
        req.num_computed_tokens = end
        if sample:
            req.num_output_placeholders += 1
        else:
            self.stats.num_prefill_chunks += 1
        self.batch.store(req, self.pool)

    def _extend_decode_steps(self, out: ScheduledStep) -> None:
        """Make a decode-only step run several tokens back to back (num_continuous_decode_steps),
        as many as every row can still take and the free blocks allow; else leave it one step.
        Rows asking for logprobs or held to a grammar keep single steps (batch.single_step)."""
        b, slots = self.batch, out.row_slots
        if not all(out.sample) or max(out.num_scheduled_tokens) != 1 or b.single_step[slots].any():
            return
        steps, missing = b.decode_steps(slots, self.config.num_continuous_decode_steps,
                                        self.pool.block_size)
        if steps < 2 or missing.sum() > self.pool.num_free_blocks:
            return
        for i in np.flatnonzero(missing).tolist():
            req = out.row_requests[i]
            allocated = self.pool.allocate_slots(req, steps - 1)
            assert allocated is not None  # the free blocks were counted above
            out.block_tables[i] = self.pool.block_tables[req.request_id]
        b.num_blocks[slots] += missing
        b.advance_decodes(out.row_requests, slots, steps - 1)
        out.num_steps = steps

    # ---- update --------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, model_out: ModelOutput) -> list[RequestOutput]:
        """Take a step's sampled tokens; returns one RequestOutput per row that produced one.

        A row whose request finished since `out` was scheduled (a stop applied one step late,
        or an abort) is discarded. A row in `model_out.row_errors` finishes its request with
        FinishReason.ERROR and the error, and no token.
        """
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        self.prompt_logprobs.take(out, model_out)
        if isinstance(out, ScheduledStep) and len(out.row_slots) == out.num_reqs:
            self._update_rows(out, model_out, outputs, finished)
        else:  # a plan this scheduler did not make
            for i in range(out.num_reqs):
                self._update_row(out, model_out, i, outputs, finished)
        self._drop_finished(finished)
        self.stats.kv_usage = self.pool.usage
        self.prompt_logprobs.attach(outputs)
        return outputs

    def _update_rows(self, out: ScheduledStep, model_out: ModelOutput,
                     outputs: list[RequestOutput], finished: list[Request]) -> None:
        """update() with the rows sorted by array ops (`RunningBatch.classify`): a row that
        only appends its tokens is done here, any other by `_update_row`."""
        codes, new_tokens = self.batch.classify(
            out, model_out, self.pool.block_size if self.pool.enable_prefix_caching else 0)
        logprobs = (itertools.repeat(None) if model_out.logprobs is None
                    else [None if lp is None else [lp] for lp in model_out.logprobs])
        cached: list[Request] = []
        append_output = outputs.append
        rows = zip(codes, out.row_requests, new_tokens, logprobs)
        for i, (code, req, tokens, lp) in enumerate(rows):
            if code == ONE_BY_ONE:
                self._update_row(out, model_out, i, outputs, finished)
                continue
            # it sampled, holds its slot, and none of its tokens stops it
            req.output_token_ids.extend(tokens)
            req.num_output_placeholders -= len(tokens)
            if code == APPEND_AND_CACHE:
                self.pool.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))
                cached.append(req)
            # NOTE: RequestOutput's fields by position: keywords cost ~0.5 ms a step more at
            # 2,048 rows
            append_output(RequestOutput(req.request_id, req.prompt_token_ids, tokens, False,
                                        None, None, "", lp, req.num_cached_tokens, None))
        if cached:
            self.batch.num_cached[[r.slot for r in cached]] = [
                self.pool.num_cached_blocks(r.request_id) for r in cached]

    def _update_row(self, out: SchedulerOutput, model_out: ModelOutput, i: int,
                    outputs: list[RequestOutput], finished: list[Request]) -> None:
        """update() for row i alone: any row (stops, errors, prefill chunks, a request
        preempted or finished since it was scheduled)."""
        req = self.requests.get(out.req_ids[i])
        if req is None:
            return  # finished since `out` was scheduled: its token is discarded
        row_errors = model_out.row_errors
        if row_errors and i in row_errors:
            self._finish(req, FinishReason.ERROR)
            self.stats.num_failed += 1
            finished.append(req)
            outputs.append(self._make_output(req, [], None, error=row_errors[i]))
            return
        if not out.sample[i]:
            self._cache_blocks(req)
        else:
            new_tokens = []
            for token in [model_out.sampled_token_ids[i], *(model_out.extra_token_ids[i]
                                                            if model_out.extra_token_ids else ())]:
                req.output_token_ids.append(token)
                req.num_output_placeholders -= 1
                new_tokens.append(token)
                self._cache_blocks(req)  # before a stop frees them
                if self._check_stop(req, token):
                    finished.append(req)
                    break  # tokens of later steps are discarded with the request
            logprobs = model_out.logprobs
            outputs.append(self._make_output(req, new_tokens,
                                             logprobs[i] if logprobs else None))
        if req.status is RequestStatus.RUNNING:
            self.batch.store(req, self.pool)

    def _cache_blocks(self, req: Request) -> None:
        """Enter the request's newly full blocks into the prefix cache (a preempted request
        holds none). Blocks below num_computed_tokens are computed by steps already scheduled,
        so any step that hits them runs after those steps."""
        if req.status is RequestStatus.RUNNING:
            self.pool.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))
            self.batch.num_cached[req.slot] = self.pool.num_cached_blocks(req.request_id)

    def _check_stop(self, req: Request, token: int) -> bool:
        """Apply the stop conditions after `token` was appended; finish the request if one holds.

        A stop token (EOS or a stop id) wins over a length limit reached by the same token.
        """
        params = req.sampling_params
        if token in req.eos_token_ids and not params.ignore_eos:
            self._finish(req, FinishReason.STOP)
        elif token in params.stop_token_ids:
            self._finish(req, FinishReason.STOP, stop_reason=token)
        elif (len(req.output_token_ids) >= params.max_tokens
              or req.num_tokens >= self.max_model_len):
            self._finish(req, FinishReason.LENGTH)
        return req.status is RequestStatus.FINISHED

    def _make_output(self, req: Request, tokens: list[int], logprobs: Logprobs | None,
                     error: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            new_token_ids=tokens, finished=req.is_finished, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, logprobs=None if logprobs is None else [logprobs],
            num_cached_tokens=req.num_cached_tokens, error=error)

    def _finish(self, req: Request, reason: FinishReason,
                stop_reason: int | str | None = None) -> None:
        """Free the request's blocks and forget it (call `_drop_finished` after)."""
        self.pool.free(req)
        self.batch.release(req)
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]
        self._finished_req_ids.append(req.request_id)

    def _drop_finished(self, finished: list[Request]) -> None:
        """Remove finished requests from the queues: one pass per queue, not one per request."""
        if not finished:
            return
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self._running_slots = None
        if len(self.requests) != len(self.running) + len(self.waiting):  # a waiting one finished
            self.waiting = deque(r for r in self.waiting if r.status is RequestStatus.WAITING)

    def check_integrity(self) -> None:
        """Recount everything from the block tables (sched/integrity.py)."""
        check_scheduler(self)
