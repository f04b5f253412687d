"""moeserve/diagnose/bounds/kv_bound.py: the idealised replay's scheduling (admission by KV room,
token budget, one token a decode step), its times at the roofline, the bound of a bench run,
and the doctor's kv_capacity verdict that states it."""

from __future__ import annotations

import dataclasses

import pytest

from moeserve.config import load_model_config
from moeserve.diagnose.bounds.kv_bound import (
    Workload,
    replay,
    run_kv_bound,
    step_seconds,
    workload_of,
)
from moeserve.diagnose.bounds.roofline import CEILINGS, step_cost
from moeserve.diagnose.doctor import diagnose
from tests.diagnose.synthetic import make_run

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


# ---- the bound of a bench run, and the doctor's kv_capacity verdict that states it ----------

def long_prompt_run(**changes):
    """Issue 14's long-prompt run as the bench records it (synthetic.py's make_run with its
    lengths, its cache and its measured input throughput, 29,144 tok/s at 71bb695)."""
    run = make_run(conc=128, cap=1935, running=78, waiting=35, kv_tokens=667360,
                   preemptions=1, step_ms=70, expert_tpe=None, diagnose=False)
    run["num_prompts"] = 128
    run["config"] = {"input_len": 8192, "output_len": 256, "workload": "random",
                     "range_ratio": 1.0}
    run["input_throughput"] = 29144.0
    for key, value in changes.items():
        if key in ("workload", "range_ratio"):
            run["config"][key] = value
        else:
            run[key] = value
    return run


def test_run_kv_bound_replays_the_runs_workload(model) -> None:
    bound = run_kv_bound(long_prompt_run())
    work = Workload(128, 8192, 256, 128, 8192)
    assert bound["workload"] == dataclasses.asdict(work)
    assert bound["with_kv_given"] == replay(model, work, 667360, H200)
    assert bound["with_room_for_all"] == replay(model, work, 128 * 8448, H200)
    assert bound["with_kv_given"]["concurrent"] == 78
    assert bound["percent"] == round(100 * 29144.0 / bound["with_kv_given"]["input_tok_per_s"], 1)


def test_the_admission_cap_limits_the_replayed_concurrency() -> None:
    run = long_prompt_run()
    run["engine"]["capacity_report"]["max_running_requests"] = 32
    assert workload_of(run).max_concurrency == 32


@pytest.mark.parametrize("change", [{"range_ratio": 0.5}, {"workload": "sharegpt"},
                                    {"num_prompts": None}])
def test_no_bound_without_fixed_lengths(change: dict) -> None:
    assert run_kv_bound(long_prompt_run(**change)) is None


def test_no_bound_for_an_unmeasured_device() -> None:
    run = long_prompt_run()
    run["engine"]["capacity_report"]["device_name"] = "NVIDIA B200"
    assert run_kv_bound(run) is None


def test_kv_capacity_states_the_bound_the_cache_allows() -> None:
    run = long_prompt_run()
    v = {v.rule: v for v in diagnose(run)}["kv_capacity"]
    bound = run_kv_bound(run)
    assert v.evidence["kv_bound"] == bound
    given, room = bound["with_kv_given"], bound["with_room_for_all"]
    assert (f"at 78 requests at a time the cache bounds this workload at "
            f"{given['input_tok_per_s']:,.0f} input tok/s (this run: "
            f"{bound['percent']:.0f}% of it); room for all 128 would allow "
            f"{room['input_tok_per_s']:,.0f}") in v.message
    assert "more KV tokens are what raises the bound" in v.knob
    assert "--kv-cache-dtype fp8 (float8 e4m3" in v.knob  # qwen3's cache in bf16
    assert "its reads take about bf16's time a step in this build" in v.knob
    fp8 = long_prompt_run()
    fp8["engine"]["capacity_report"]["engine_config"]["cache"]["kv_cache_dtype"] = "fp8"
    assert "--kv-cache-dtype" not in {v.rule: v for v in diagnose(fp8)}["kv_capacity"].knob
    mla = long_prompt_run()  # a latent cache too
    mla["engine"]["capacity_report"]["engine_config"]["model"] = "glm-4.7-flash"
    knob = {v.rule: v for v in diagnose(mla)}["kv_capacity"].knob
    assert "--kv-cache-dtype fp8" in knob
    assert "its latent reads take about twice bf16's time a step in this build" in knob
    # a run whose cache holds its concurrency gets no replay, whatever else fired
    roomy = long_prompt_run()
    roomy["engine"]["capacity_report"]["kv_tokens"] = 2_000_000
    assert all("kv_bound" not in v.evidence for v in diagnose(roomy))


def test_an_fp8_cache_halves_the_attention_bytes_of_the_bound(model) -> None:
    bf16 = step_cost(model, 2, 64, 64, 64, 8192)
    fp8 = step_cost(model, 2, 64, 64, 64, 8192, kv_elem_bytes=1)
    assert fp8.kv_bytes * 2 == bf16.kv_bytes and fp8.expert_bytes == bf16.expert_bytes
    glm5 = load_model_config("glm-5")[0]  # its indexer keys stay bf16
    latent = 8192 * glm5.num_layers * glm5.mla.latent_dim
    index = 8192 * glm5.index_cache_layers * glm5.dsa.index_head_dim
    assert step_cost(glm5, 2, 1, 1, 1, 8192, kv_elem_bytes=1).kv_bytes == \
        min(8192, glm5.dsa.index_topk) / 8192 * latent + 2 * index
    run = long_prompt_run()
    run["engine"]["capacity_report"]["engine_config"]["cache"]["kv_cache_dtype"] = "fp8"
    run["engine"]["capacity_report"]["kv_tokens"] = 2 * 667360
    bound = run_kv_bound(run)
    work = Workload(128, 8192, 256, 128, 8192)
    assert bound["with_kv_given"] == replay(model, work, 2 * 667360, H200, kv_elem_bytes=1)
    assert bound["with_kv_given"]["concurrent"] == 128
