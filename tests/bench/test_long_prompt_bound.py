"""benchmarks/engine/long_prompt_bound.py: the idealised replay's scheduling (admission by KV room,
token budget, one token a decode step) and its times at the roofline."""

from __future__ import annotations

import pytest

from benchmarks.engine.long_prompt_bound import Workload, replay, step_seconds
from moeserve.config import load_model_config
from moeserve.diagnose.roofline import CEILINGS

H200 = CEILINGS[0]


@pytest.fixture(scope="module")
def model():
    return load_model_config("qwen3-30b-a3b")[0]


def test_kv_room_for_one_runs_the_requests_one_after_another(model) -> None:
    # a 4-token prompt in one step (sampling the 1st token), then 2 decode steps: 3 steps each
    work = Workload(num_prompts=2, input_len=4, output_len=3, max_concurrency=2,
                    token_budget=8)
    one = replay(model, work, kv_tokens=7, ceilings=H200)
    both = replay(model, work, kv_tokens=14, ceilings=H200)
    assert (one["concurrent"], one["steps"], one["steps_with_prompt_tokens"]) == (1, 6, 2)
    assert (both["concurrent"], both["steps"], both["steps_with_prompt_tokens"]) == (2, 3, 1)
    assert both["duration_s"] < one["duration_s"]


def test_the_token_budget_chunks_long_prompts(model) -> None:
    work = Workload(num_prompts=1, input_len=10, output_len=1, max_concurrency=1,
                    token_budget=4)
    assert replay(model, work, 11, H200)["steps"] == 3  # chunks of 4, 4 and 2


def test_a_cache_smaller_than_one_request_is_refused(model) -> None:
    with pytest.raises(ValueError, match="cannot hold one request of 8448"):
        replay(model, Workload(), kv_tokens=8000, ceilings=H200)


def test_step_time_grows_with_context_and_chunk(model) -> None:
    short = step_seconds(model, 2, [128] * 64, [], H200)
    assert step_seconds(model, 2, [8192] * 64, [], H200) > short
    assert step_seconds(model, 2, [128] * 64, [(0, 4096)], H200) > short
    # a chunk after cached context attends more keys than the same chunk fresh
    assert (step_seconds(model, 2, [], [(6144, 2048)], H200)
            > step_seconds(model, 2, [], [(0, 2048)], H200))


def test_more_kv_is_never_slower(model) -> None:
    work = Workload(num_prompts=16, input_len=1024, output_len=32, max_concurrency=16)
    times = [replay(model, work, kv, H200)["duration_s"] for kv in (1056, 4224, 16896)]
    assert times[0] > times[1] > times[2]
