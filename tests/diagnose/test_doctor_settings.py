"""Each verdict's `settings`: the engine config fields and values its rule proposes, for a tuner
that steers by them. They name real fields (engine_config_from_kwargs takes them) and agree
with the knob the verdict names in words."""

from __future__ import annotations

import argparse

import pytest

from moeserve.diagnose.doctor import diagnose
from moeserve.diagnose.verdict import as_flags
from moeserve.engine.args import add_engine_args, engine_config_from_kwargs, engine_kwargs_from_args
from tests.diagnose.synthetic import make_run
from tests.diagnose.test_host_rules import _cpu_run, _loop


def _tiles(tuned: bool) -> dict:
    return {str(n): {"tiles": "M16_N64_K128_G1_w4_s4", "tuned": tuned,
                     "source": "x.json" if tuned else "default"} for n in (1, 64, 256)}


CASES = [
    # admission_cap: an explicit cap goes to the client's concurrency (the KV fits 1,935)
    ("admission_cap", make_run(cap=64, cap_setting=64, running=64, waiting=960, expert_tpe=4.0,
                               step_ms=20), {"max_running_requests": 1024}),
    # ... an auto cap set by the KV: an explicit cap at the concurrency
    ("admission_cap", make_run(conc=2048, cap=1935, running=1935, waiting=113),
     {"max_running_requests": 2048}),
    # ... an auto cap that assumed larger requests than these
    ("admission_cap", make_run(conc=2048, cap=967, running=967, waiting=1081,
                               scheduler__expected_tokens_per_request=512),
     {"expected_tokens_per_request": 256}),
    # ... an auto cap set by the request pool
    ("admission_cap", make_run(conc=8192, cap=4096, running=4096, waiting=200,
                               kv_tokens=4_000_000), {"request_pool": 8192}),
    # kv_capacity: more of the GPU's memory while mem_fraction has room, else what the KV holds
    ("kv_capacity", make_run(preemptions=7), {"mem_fraction": 0.95}),
    ("kv_capacity", make_run(preemptions=7, cache__mem_fraction=0.95),
     {"max_running_requests": 1935}),
    ("kv_capacity", make_run(kv_usage=0.97), {}),  # info: a full cache without preemption
    # cuda_graphs: what the capacity report says keeps them off
    ("cuda_graphs", make_run(cuda_graphs="off: enforce_eager"), {"enforce_eager": False}),
    ("cuda_graphs", make_run(cuda_graphs="off: attention backend 'torch' cannot be captured "
                                         "(use triton)"), {"attention_backend": "triton"}),
    ("cuda_graphs", make_run(cuda_graphs="off: MoE backend 'grouped_mm' in float16 cannot be "
                                         "captured"), {"moe_backend": "triton"}),
    ("cuda_graphs", make_run(stats_extra={"num_graph_fallbacks": [0.0] * 40 + [12.0] * 42}),
     {"cuda_graph_max_batch_size": "auto"}),
    # tokens_per_expert: the engine's cap when it holds the batch below the client's
    ("tokens_per_expert", make_run(cap=64, cap_setting=64, running=64, waiting=960,
                                   expert_tpe=4.0, step_ms=20), {"max_running_requests": 1024}),
    ("tokens_per_expert", make_run(expert_tpe=8.0), {}),  # the client's load is the limit
    ("cpu_threads", _cpu_run(threads=8, cores=2, engine_cpu=1.9), {"torch_threads": 2}),
    ("cpu_bound_step", make_run(counters=_loop(wall_ms=50.0, device_ms=25.0),
                                async_scheduling=False), {"async_scheduling": True}),
    ("gpu_power", make_run(power=250, limit=600, util=40, engine_cpu=0.4), {}),
    ("client_bound", make_run(client_cpu=0.97), {}),
    ("api_bound", make_run(api_cpu=0.95), {}),
    ("roofline", make_run(step_ms=60), {}),
    # moe_tiles: default tiles the engine was told to use; default tiles for want of a tune
    ("moe_tiles", make_run(moe_backend="measured", moe_tiles="default",
                           capacity_extra={"moe_configs": _tiles(tuned=False)}),
     {"moe_tiles": "tuned"}),
    ("moe_tiles", make_run(moe_backend="triton", moe_tiles="tuned",
                           capacity_extra={"moe_configs": _tiles(tuned=False)}), {}),
]


@pytest.mark.parametrize("rule, run, settings", CASES,
                         ids=[f"{rule}-{i}" for i, (rule, _, _) in enumerate(CASES)])
def test_each_rule_proposes_engine_settings(rule: str, run: dict, settings: dict) -> None:
    v = {v.rule: v for v in diagnose(run)}[rule]
    assert v.settings == settings
    engine_config_from_kwargs(model="tiny-moe", **v.settings)  # real fields, valid values
    assert v.to_dict()["settings"] == settings


def test_settings_agree_with_the_knob() -> None:
    run = make_run(cap=64, cap_setting=64, running=64, waiting=960, expert_tpe=4.0, step_ms=20)
    fired = {v.rule: v for v in diagnose(run)}
    assert "--max-running-requests auto, or 1024" in fired["admission_cap"].knob
    assert "--max-running-requests 1024 (the cap 64 is below the client's 1024 in flight)" in \
        fired["tokens_per_expert"].knob
    v = {v.rule: v for v in diagnose(make_run(conc=8192, cap=4096, running=4096, waiting=200,
                                              kv_tokens=4_000_000))}["admission_cap"]
    assert v.knob.startswith("--request-pool 8192 (the cap is the pool, 4096)")
    v = {v.rule: v for v in diagnose(make_run(cuda_graphs="off: enforce_eager"))}["cuda_graphs"]
    assert "turn CUDA graphs on (--no-enforce-eager)" in v.knob


def test_settings_as_flags() -> None:
    """The flags the CLI parses back into the same settings."""
    settings = {"enforce_eager": False, "async_scheduling": True, "torch_threads": 2,
                "cuda_graph_max_batch_size": "auto", "mem_fraction": 0.95}
    flags = as_flags(settings)
    assert flags == ("--no-enforce-eager --async-scheduling --torch-threads 2 "
                     "--cuda-graph-max-batch-size auto --mem-fraction 0.95")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs_from_args(parser.parse_args(flags.split())) == settings


def test_moe_tiles_is_silent_with_tuned_tiles_or_without_the_fused_moe() -> None:
    tuned = make_run(moe_backend="measured", moe_tiles="tuned",
                     capacity_extra={"moe_configs": _tiles(tuned=True)})
    grouped = make_run(moe_backend="grouped_mm", capacity_extra={"moe_configs": {}})
    cpu = make_run(device="cpu", moe_backend="triton",
                   capacity_extra={"moe_configs": _tiles(tuned=False)})
    for run in (tuned, grouped, cpu):
        assert "moe_tiles" not in {v.rule for v in diagnose(run)}
