"""The prompts a repetition penalty needs on the device: HF's and vLLM's repetition penalty
covers the prompt's tokens too, which a decode step's plan does not carry (nor a prefix-cache
hit's). So the first plan that schedules such a request names its prompt
(`SchedulerOutput.penalty_prompts`), and the runner keeps it until the plan that names the
request finished (runner/penalties.py). A preempted request's prompt stays with the runner."""

from __future__ import annotations

from collections.abc import Iterable

from moeserve.sched.request import Request
from moeserve.types import SchedulerOutput


class PenaltyPrompts:
    """The requests with a repetition penalty whose prompt no plan has carried yet."""

    def __init__(self) -> None:
        self._unsent: dict[str, list[int]] = {}

    def add(self, req: Request) -> None:
        if req.sampling_params.repetition_penalty != 1.0:
            self._unsent[req.request_id] = req.prompt_token_ids

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._unsent.pop(request_id, None)

    def plan(self, out: SchedulerOutput) -> None:
        if not self._unsent:
            return
        for i, request_id in enumerate(out.req_ids):
            prompt = self._unsent.pop(request_id, None)
            if prompt is not None:
                out.penalty_prompts.append((i, prompt))
