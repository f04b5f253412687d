"""The sampled step profile: forward, attention and MoE time of every Nth step, and its totals
(sampled forwards, their device seconds, their steps' wall seconds per forward)."""

from __future__ import annotations

import asyncio

import pytest
import torch

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


def test_profile_times_mla_attention(tmp_path) -> None:
    """MLA layers (DeepSeek, GLM-4.7-Flash) are timed as attention too."""
    from tests.models.checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint("glm4_moe_lite", tmp_path / "ckpt")
    llm = LLM(folder, device="cpu", dtype="float32", step_profile_every=1)
    llm.generate([[1, 2, 3, 4], [5, 6]], PARAMS)
    sample = llm.engine.runner.profiler.latest
    assert sample is not None and sample.attention_ms > 0 and sample.moe_ms > 0


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


class _Clock:
    """A host clock the test moves (the profiler's clocks on CPU are time.perf_counter)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_totals_pair_a_sampled_forward_with_its_steps_wall(monkeypatch) -> None:
    """A sampled forward joins the totals once its device time and its step's wall time are
    both known; a sample no step claims (warm-up) never does."""
    import moeserve.runner.step_profile as sp

    clock = _Clock()
    monkeypatch.setattr(sp.time, "perf_counter", clock)
    profiler = StepProfiler(torch.nn.Linear(1, 1), torch.device("cpu"), every=2)
    walls = []
    for i, (device_s, wall_s) in enumerate([(0.010, 0.030), (0.004, 0.004), (0.020, 0.025)]):
        profiler.begin()  # forward 2i is sampled (every=2), forward 2i + 1 is not
        clock.now += device_s
        profiler.end(num_tokens=8)
        profiler.begin()
        profiler.end(num_tokens=8)
        ids = profiler.take_sampled()
        assert ids == (2 * i,)
        walls.append((ids, wall_s))
    assert profiler.num_profiled_forwards == 0  # no step has handed back its wall yet
    for ids, wall_s in walls:
        profiler.add_step_wall(ids, wall_s)
    assert profiler.num_profiled_forwards == 3
    assert profiler.profiled_device_seconds_total == pytest.approx(0.034)
    assert profiler.profiled_wall_seconds_total == pytest.approx(0.059)
    assert profiler.latest.forward_ms == pytest.approx(20.0)
    profiler.begin()
    profiler.end(num_tokens=1)  # never claimed
    profiler.reset_counters()
    assert (profiler.num_profiled_forwards, profiler.profiled_wall_seconds_total) == (0, 0.0)
    assert profiler.take_sampled() == ()


def test_multi_step_plans_give_each_forward_its_share_of_the_step() -> None:
    """Every forward sampled (every=1), 4 forwards per decode plan: every forward's sample
    is claimed by its step, with the step's wall over its 4 forwards, so the wall total
    covers the device total (each forward runs inside its step)."""
    llm = LLM("tiny-moe", device="cpu", step_profile_every=1, num_continuous_decode_steps=4)
    runner = llm.engine.runner
    llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=9, temperature=0.0,
                                                        ignore_eos=True))
    profiler = runner.profiler
    assert runner.num_forward_steps > llm.engine.scheduler.stats.num_scheduled_steps
    assert profiler.num_profiled_forwards == runner.num_forward_steps
    assert profiler.profiled_wall_seconds_total >= profiler.profiled_device_seconds_total > 0


def test_engine_stats_carry_the_profile_totals() -> None:
    """The engine process's stats (what /v1/engine and /metrics serve): the totals exist and
    grow with each request."""
    from moeserve.engine.process.async_client import AsyncEngineClient

    engine = {"model": "tiny-moe", "device": "cpu", "max_model_len": 256,
              "step_profile_every": 2}

    async def main() -> None:
        client = await AsyncEngineClient.start(engine)
        try:
            seen = []
            for rid in ("a", "b"):
                async for _ in client.generate(rid, [1, 2, 3], PARAMS):
                    pass
                assert await client.check_ready()  # a fresh snapshot
                s = client.stats
                seen.append((s.num_profiled_forwards, s.profiled_device_seconds_total,
                             s.profiled_wall_seconds_total))
            assert 0 < seen[0][0] < seen[1][0]
            assert 0 < seen[0][1] < seen[1][1] and 0 < seen[0][2] < seen[1][2]
            report = client.capacity_report
            assert report["torch_threads"] >= 1 and report["usable_cores"] >= 1
        finally:
            await client.shutdown()

    asyncio.run(main())
