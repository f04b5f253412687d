"""One request's scheduling state: its tokens, how many of them are in the KV cache, its status.

The scheduler owns every Request; the engine builds it (after validating it) and hands it over
with `Scheduler.add_request`. Token positions of a request:

    [0, num_prompt_tokens)                    prompt
    [num_prompt_tokens, num_tokens)           outputs known to the scheduler
    [num_tokens, num_tokens + placeholders)   outputs sampled by in-flight steps, not known yet
    [0, num_computed_tokens)                  in the KV cache, or scheduled into it by a step

`num_computed_tokens` advances when a step is scheduled (optimistically), so it may run ahead of
`num_tokens` by the in-flight placeholders; it catches up with `num_tokens + placeholders` one
chunk at a time, which makes chunked prefill, prefix-cache hits and decode one mechanism.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moeserve.types import FinishReason, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (then it holds no blocks and recomputes)
    RUNNING = "running"  # holds KV blocks; scheduled each step while the token budget allows
    FINISHED = "finished"  # blocks freed; no longer known to the scheduler


@dataclass(slots=True, eq=False)
class Request:
    """A request and its mutable scheduling state (compared by identity)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end generation unless sampling_params.ignore_eos."""
    seed: int = 0
    """Resolved sampling seed (the request's own, or one the engine derived)."""
    arrival_seq: int = 0
    """Arrival order, set by the engine."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    """Tokens that scheduled steps will sample but whose ids update() has not delivered yet."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    """Prefix-cache hit tokens at its last admission."""
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of its full blocks, filled lazily by the block pool."""
    slot: int = -1
    """Its slot in the scheduler's running arrays (sched/batch.py) while RUNNING, else -1."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + outputs (in-flight placeholders excluded)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end), -1 where the token is still in flight.

        Slices prompt and outputs separately: no copy of the whole sequence per decode step.
        """
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        ids = self.prompt_token_ids[start:num_prompt] if start < num_prompt else []
        ids += self.output_token_ids[max(start - num_prompt, 0):end - num_prompt]
        if len(ids) < end - start:
            ids += [-1] * (end - start - len(ids))
        return ids
