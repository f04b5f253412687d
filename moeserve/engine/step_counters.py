"""What the step loop counts, for stats and metrics: `StepCounters`.

Beside the cumulative token counts it keeps the latest slow steps: each step whose wall time
reached SLOW_STEP_SECONDS, with its number and what it held (prompt tokens, decode rows, tokens
generated: a multi-step plan generates several a row), the last SLOW_STEPS_KEPT of them. A
run's share is those numbered after its start (bench/engine_run.py); the doctor's `step_stall`
rule compares their seconds a token with the run's: a step that took far longer than its tokens
explain is a stall (a kernel compiled at first use, a host pause), not work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeserve.types import RequestOutput, SchedulerOutput

SLOW_STEP_SECONDS = 0.25
SLOW_STEPS_KEPT = 8


@dataclass(slots=True)
class StepCounters:
    """Cumulative token counts of the step loop and its latest slow steps."""

    num_prompt_tokens: int = 0  # tokens computed for prompts (recomputation included)
    num_generated_tokens: int = 0
    last_step_seconds: float = 0.0
    schedule_seconds: float = 0.0  # the last schedule() call
    num_recorded_steps: int = 0  # steps recorded since start (the slow steps' numbering)
    # (step number, wall seconds, prompt tokens, decode rows, tokens generated) of the latest
    # slow steps
    slow_steps: deque[tuple[int, float, int, int, int]] = field(
        default_factory=lambda: deque(maxlen=SLOW_STEPS_KEPT))

    def record(self, out: SchedulerOutput, outputs: list[RequestOutput], seconds: float) -> None:
        """One settled step: `seconds` the wall time of the engine call that settled it."""
        decodes = sum(1 for n, k in zip(out.num_scheduled_tokens, out.num_output_tokens)
                      if n == 1 and k > 0)
        prompt = out.total_num_tokens - decodes
        self.num_prompt_tokens += prompt
        generated = sum(len(o.new_token_ids) for o in outputs)
        self.num_generated_tokens += generated
        self.last_step_seconds = seconds
        self.num_recorded_steps += 1
        if seconds >= SLOW_STEP_SECONDS:
            self.slow_steps.append((self.num_recorded_steps, seconds, prompt, decodes, generated))
