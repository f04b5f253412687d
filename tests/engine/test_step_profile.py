"""The sampled step profile: forward, attention and MoE time of every Nth step."""

from __future__ import annotations

from moeserve import LLM, SamplingParams
from moeserve.runner.step_profile import StepProfiler

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_profile_splits_the_forward() -> None:
    llm = LLM("tiny-moe", device="cpu", step_profile_every=3)
    profiler = llm.engine.runner.profiler
    llm.generate([[1, 2, 3, 4], [5, 6]], PARAMS)
    sample = profiler.latest
    assert sample is not None and sample.num_tokens in (2, 6)  # a decode step or the prefill
    assert sample.attention_ms > 0 and sample.moe_ms > 0
    assert sample.forward_ms >= sample.attention_ms + sample.moe_ms
    assert sample.other_ms == sample.forward_ms - sample.attention_ms - sample.moe_ms


def test_only_every_nth_forward_is_timed() -> None:
    llm = LLM("tiny-moe", device="cpu", step_profile_every=4)
    profiler: StepProfiler = llm.engine.runner.profiler
    samples = []
    for _ in range(8):
        before = profiler._count
        profiler.begin()
        samples.append(profiler._active)
        profiler.end(1)
        assert profiler._count == before + 1
    assert samples == [True, False, False, False, True, False, False, False]


def test_profile_off() -> None:
    llm = LLM("tiny-moe", device="cpu", step_profile_every=0)
    llm.generate([[1, 2]], PARAMS)
    assert llm.engine.runner.profiler is None
