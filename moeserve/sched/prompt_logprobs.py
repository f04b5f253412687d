"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's; /v1/completions' echo with logprobs):
the logprob of each prompt token after the tokens before it, with the top n, from the hidden
rows the prefill computes anyway.

Entry k (1 <= k < P, P the prompt's length) is prompt[k]'s logprob, read from the logits of
position k - 1; the first prompt token has none (the server writes null for it). A step whose
row computes positions [start, end) of a prompt gives entries start + 1 .. min(end, P - 1):

    plan(out)             the step's spans, (row, first entry, count), and their target token ids
                          into the plan (the runner computes them: runner/prompt_logprobs.py)
    take(out, model_out)  the step's entries kept per request, in order; entries a request
                          already holds (a preempted request recomputes its prompt) are dropped
    attach(outputs)       each request's entries not sent yet, onto its output of this step (a
                          prefill chunk that samples nothing makes none: they wait for the first)
    cached_prefix_allowed(req)  False until its entries are all computed: a prefix-cache hit's
                          tokens have no hidden rows, so such a request reads no hit until then
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from moeserve.sched.request import Request
from moeserve.types import Logprobs, ModelOutput, RequestOutput, SchedulerOutput


@dataclass(slots=True)
class _Entries:
    num_prompt: int
    entries: list[Logprobs] = field(default_factory=list)  # entry k at index k - 1
    num_sent: int = 0


class PromptLogprobs:
    """The engine's requests that asked for prompt logprobs (see the module docstring)."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Entries] = {}

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def add(self, req: Request) -> None:
        if req.sampling_params.prompt_logprobs is not None:
            self._reqs[req.request_id] = _Entries(req.num_prompt_tokens)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._reqs.pop(request_id, None)

    def cached_prefix_allowed(self, req: Request) -> bool:
        state = self._reqs.get(req.request_id)
        return state is None or len(state.entries) >= state.num_prompt - 1

    def plan(self, out: SchedulerOutput) -> None:
        """The plan's prompt-logprob spans and their targets (prompt[k] for each entry k)."""
        if not self._reqs:
            return
        for i, request_id in enumerate(out.req_ids):
            state = self._reqs.get(request_id)
            if state is None:
                continue
            start = out.num_computed_tokens[i]
            first = max(start + 1, len(state.entries) + 1)
            last = min(start + out.num_scheduled_tokens[i], state.num_prompt - 1)
            if first <= last:
                out.prompt_logprob_spans.append((i, first, last - first + 1))
                prompt = out.row_requests[i].prompt_token_ids  # type: ignore[attr-defined]
                out.prompt_logprob_targets += prompt[first:last + 1]

    def take(self, out: SchedulerOutput, model_out: ModelOutput) -> None:
        """Keep the entries the step computed, in entry order, each once."""
        if not model_out.prompt_logprobs:
            return
        for (row, first, _count), got in zip(out.prompt_logprob_spans,
                                             model_out.prompt_logprobs or (), strict=True):
            state = self._reqs.get(out.req_ids[row])
            if state is None:
                continue  # finished since it was scheduled
            held = len(state.entries)
            if first <= held + 1:  # contiguous with what it holds (overlapping after a preemption)
                state.entries += got[held + 1 - first:]

    def attach(self, outputs: list[RequestOutput]) -> None:
        """Each output's request's entries not sent yet, as its `prompt_logprobs`; a request
        whose entries are all sent, or that finished, is forgotten."""
        if not self._reqs:
            return
        for o in outputs:
            state = self._reqs.get(o.request_id)
            if state is None:
                continue
            o.prompt_logprobs = state.entries[state.num_sent:]
            state.num_sent = len(state.entries)
            if o.finished or state.num_sent >= state.num_prompt - 1:
                del self._reqs[o.request_id]
