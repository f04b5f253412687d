"""The scheduler's cumulative counters (the engine's stats and /metrics read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters (kv_usage is the current fraction of usable KV blocks in use)."""

    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefill_chunks: int = 0  # prefill chunks that stopped short of the end of the tokens
    num_scheduled_steps: int = 0  # schedule() calls that scheduled at least one request
    num_aborted: int = 0
    num_failed: int = 0  # requests finished with FinishReason.ERROR (a fault of their own)
    kv_usage: float = 0.0
