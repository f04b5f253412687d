"""engine/step_counters.py: the step loop's token counts and its latest slow steps."""

from __future__ import annotations

from types import SimpleNamespace

from moeserve.engine.step_counters import SLOW_STEP_SECONDS, SLOW_STEPS_KEPT, StepCounters


def _out(prompt: int, decodes: int) -> SimpleNamespace:
    """A SchedulerOutput's counts: one prompt chunk of `prompt` tokens, `decodes` decode rows."""
    scheduled = ([prompt] if prompt else []) + [1] * decodes
    outputs = ([0] if prompt else []) + [1] * decodes
    return SimpleNamespace(num_scheduled_tokens=scheduled, num_output_tokens=outputs,
                           total_num_tokens=prompt + decodes)


def test_counts_and_the_latest_slow_steps() -> None:
    c = StepCounters()
    c.record(_out(100, 3), [SimpleNamespace(new_token_ids=[7])] * 3, 0.01)
    assert (c.num_prompt_tokens, c.num_generated_tokens, c.num_recorded_steps) == (100, 3, 1)
    assert not c.slow_steps and c.last_step_seconds == 0.01
    gen = [SimpleNamespace(new_token_ids=[1, 2])] * 128  # a plan of two forwards
    c.record(_out(0, 128), gen, SLOW_STEP_SECONDS)  # at the threshold: slow
    c.record(_out(4096, 2), [], SLOW_STEP_SECONDS - 1e-3)
    assert list(c.slow_steps) == [(2, SLOW_STEP_SECONDS, 0, 128, 256)]
    for i in range(SLOW_STEPS_KEPT + 2):  # only the latest are kept
        c.record(_out(8, 1), [], 1.0 + i)
    assert len(c.slow_steps) == SLOW_STEPS_KEPT
    assert c.slow_steps[-1] == (c.num_recorded_steps, 1.0 + SLOW_STEPS_KEPT + 1, 8, 1, 0)
    assert c.slow_steps[0][0] == c.num_recorded_steps - SLOW_STEPS_KEPT + 1
