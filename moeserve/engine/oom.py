"""A forward that runs out of device memory (torch.OutOfMemoryError) with the engine staying up
for the other requests: `OomRecovery`, called by EngineCore.step.

The memory plan profiles the largest step at start-up, so an out-of-memory forward is a step it
did not foresee (fragmentation, a kernel's workspace, another process on the device). Such a
step is no request's fault at first: its requests are preempted by recompute (their tokens and
outputs so far are kept; they come back first) and the allocator's cache is emptied. If a step
fails again while holding the request that was the largest of an earlier failed step (by tokens
scheduled), that request is the likely cause: it fails alone with an error naming the limits
to lower, and the rest are preempted again. Nothing accepted is lost unless it failed twice.

With async scheduling a step may be in flight beside the failed one: an older step (the
failure was the next launch) is settled normally, a newer one (launched on the failed step's
tokens) is discarded with it.
"""

from __future__ import annotations

import logging

import torch

from moeserve.runner.pending_output import PendingOutput
from moeserve.sched import Scheduler
from moeserve.types import RequestOutput, SchedulerOutput

logger = logging.getLogger("moeserve.engine")


class OomRecovery:
    """The engine's answer to an out-of-memory forward (the module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.suspects: set[str] = set()  # the largest request of each failed step so far
        self.num_recoveries = 0
        self.num_failed = 0

    def recover(self, error: torch.OutOfMemoryError, failed: list[SchedulerOutput],
                in_flight: tuple[SchedulerOutput, PendingOutput] | None,
                in_flight_is_older: bool) -> list[RequestOutput]:
        """The outputs of a step that raised `error`: `failed` the steps that ran out of
        memory; `in_flight` the other launched step, settled when older than the failure,
        discarded when launched on the failed step's tokens."""
        outputs: list[RequestOutput] = []
        if in_flight is not None:
            step, pending = in_flight
            try:
                result = pending.result()
            except torch.OutOfMemoryError:
                result = None
            if in_flight_is_older and result is not None:
                outputs = self.scheduler.update(step, result)
            else:
                failed = [*failed, step]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.num_recoveries += 1
        suspect, tokens = _largest(failed[0])
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        failed_now = ""
        if suspect in self.suspects:
            self.num_failed += 1
            failed_now = f"; {suspect!r} failed, the largest of two failed steps"
            budget = self.scheduler.config.max_num_batched_tokens
            out = self.scheduler.fail_request(suspect, (
                f"out of device memory: a forward step holding this request ({tokens} tokens "
                f"scheduled, the step's largest) ran out of device memory for the second time; "
                f"the engine goes on serving the others. Shorten the prompt, or lower "
                f"max_num_batched_tokens ({budget}) or mem_fraction ({reason})"))
            if out is not None:
                outputs.append(out)
        self.suspects.add(suspect)
        ids = [i for step in failed for i in step.req_ids]
        preempted = self.scheduler.retry_later(ids)
        logger.warning("a forward ran out of device memory (%s): %d requests preempted to "
                       "recompute%s", reason, len(preempted), failed_now)
        return outputs


def _largest(step: SchedulerOutput) -> tuple[str, int]:
    """The step's request with the most tokens scheduled (ties: the later row), and that
    count."""
    best = max(range(step.num_reqs), key=lambda i: (step.num_scheduled_tokens[i], i))
    return step.req_ids[best], step.num_scheduled_tokens[best]
