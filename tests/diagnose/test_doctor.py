"""Each doctor rule fires on its case, cites its figures, names its knob, and stays quiet on a
healthy run (synthetic run objects from synthetic.py)."""

from __future__ import annotations

import pytest

from moeserve.diagnose.doctor import Verdict, diagnose, format_verdicts, summary_lines
from tests.diagnose.synthetic import make_run


def _fired(run: dict) -> dict[str, Verdict]:
    return {v.rule: v for v in diagnose(run)}


def test_healthy_run_gets_no_verdict() -> None:
    run = make_run()
    assert diagnose(run) == []
    assert format_verdicts([]) == ["no verdict: no rule fired"]
    text = "\n".join(summary_lines(run))
    assert "roofline: memory-bound" in text and "GPU 0: 550 of 700 W" in text
    assert "64.0 tokens per expert per step" in text


def test_admission_cap_explicit_64_at_concurrency_1024() -> None:
    # the seeds' first finding: running pinned at 64 while 960 wait
    run = make_run(cap=64, cap_setting=64, running=64, waiting=960, expert_tpe=4.0, step_ms=20)
    fired = _fired(run)
    assert set(fired) == {"admission_cap", "tokens_per_expert"}
    v = fired["admission_cap"]
    assert v.severity == "critical"
    assert v.evidence["max_running_requests"] == 64 and v.evidence["setting"] == 64
    assert v.evidence["share_of_samples"] > 0.95 and v.evidence["mean_waiting_when_capped"] == 960
    assert v.evidence["requests_kv_fits"] == 495488 // 256
    assert "--max-running-requests auto, or 1024" in v.knob
    assert "64" in v.message and "960" in v.message


def test_admission_cap_auto_names_the_kv_knobs() -> None:
    run = make_run(conc=2048, cap=1935, running=1935, waiting=113)
    v = _fired(run)["admission_cap"]
    assert v.evidence["setting"] == "auto"
    assert v.knob == ("--mem-fraction (a larger KV cache raises the auto cap), or "
                      "--max-running-requests 2048 (preemption absorbs the overflow)")
    # the rule assumed more tokens per request than this workload holds
    run = make_run(conc=2048, cap=967, running=967, waiting=1081,
                   scheduler__expected_tokens_per_request=512)
    assert "--expected-tokens-per-request 256 (the rule assumed 512" in \
        _fired(run)["admission_cap"].knob
    run = make_run(conc=4096, cap=4096, running=4096, waiting=200, kv_tokens=2_000_000)
    assert _fired(run)["admission_cap"].knob.startswith("--request-pool")


def test_admission_cap_quiet_when_waiting_is_rare() -> None:
    run = make_run(cap=1024, cap_setting=1024, running=1024, waiting=0)
    stats = run["diagnostics"]["engine_timeline"]["stats"]
    stats["num_waiting"][5:8] = [3, 3, 3]  # 3 of 82 samples: a blip, not a binding cap
    assert "admission_cap" not in _fired(run)


@pytest.mark.parametrize("kwargs, needle, severity", [
    ({"preemptions": 7}, "7 preemptions", "warning"),
    ({"conc": 2048, "cap": 4096, "running": 2048, "step_ms": 30}, "2048 requests x 256 tokens",
     "warning"),
    ({"kv_usage": 0.97}, "KV usage reached 97%", "info"),
])
def test_kv_capacity(kwargs: dict, needle: str, severity: str) -> None:
    fired = _fired(make_run(**kwargs))
    assert set(fired) == {"kv_capacity"}
    v = fired["kv_capacity"]
    assert needle in v.message and v.severity == severity
    assert "--mem-fraction" in v.knob and "--max-model-len" in v.knob
    assert "--max-running-requests 1935" in v.knob  # what 495,488 KV tokens hold at 256 each
    assert v.evidence["kv_tokens"] == 495488


def test_cuda_graphs_off_or_falling_back() -> None:
    v = _fired(make_run(cuda_graphs="off: decode runs eager"))["cuda_graphs"]
    assert "off: decode runs eager" in v.message and "CUDA graphs on" in v.knob
    fallback = [0.0] * 40 + [12.0] * 42
    v = _fired(make_run(stats_extra={"num_graph_fallbacks": fallback}))["cuda_graphs"]
    assert v.evidence["fallbacks"] == {"num_graph_fallbacks": 12.0}
    # graphs mean nothing on a CPU engine
    cpu = make_run(cuda_graphs="off: decode runs eager", device="cpu")
    assert "cuda_graphs" not in _fired(cpu)


def test_tokens_per_expert_from_counters_and_estimate() -> None:
    v = _fired(make_run(expert_tpe=8.0))["tokens_per_expert"]
    assert v.severity == "critical"
    assert v.evidence["mean_tokens_per_expert_per_step"] == 8.0
    assert v.evidence["source"] == "expert_load counters"
    # the cap (1,935) is above the client's 1,024: only more load raises the batch
    assert v.knob.startswith("raise the batch: more requests in flight (--max-concurrency, now "
                             "1024)") and v.settings == {}
    v = _fired(make_run(expert_tpe=24.0))["tokens_per_expert"]
    assert v.severity == "warning"
    # no counters: estimated from the batch (192 tokens x top-8 / 128 experts = 12)
    run = make_run(expert_tpe=None, running=192, step_ms=16)
    v = _fired(run)["tokens_per_expert"]
    assert v.evidence["mean_tokens_per_expert_per_step"] == 12.0
    assert v.evidence["source"].startswith("estimate")


def test_gpu_power_far_under_limit() -> None:
    fired = _fired(make_run(power=250, limit=600, util=40, engine_cpu=0.4))
    assert set(fired) == {"gpu_power"}
    v = fired["gpu_power"]
    assert v.evidence["mean_power_w"] == 250 and v.evidence["power_limit_w"] == 600
    assert "250 of 600 W" in v.message
    # low power at high utilisation is a memory-bound GPU, not a waiting one
    assert "gpu_power" not in _fired(make_run(power=250, limit=600, util=95))


def test_idle_gpus_on_the_host_do_not_fire() -> None:
    assert diagnose(make_run(idle_gpus=7)) == []


def test_client_bound() -> None:
    fired = _fired(make_run(client_cpu=0.97))
    assert set(fired) == {"client_bound"}
    assert fired["client_bound"].knob.startswith("--workers 2")
    assert fired["client_bound"].evidence["client_cpu_fractions"] == [0.97]


def test_api_bound_from_processes_and_from_metrics() -> None:
    v = _fired(make_run(api_cpu=0.95))["api_bound"]
    assert v.knob.startswith("--api-servers 2") and v.evidence["source"].startswith("psutil")
    run = make_run(api_cpu=0.96, api_servers=2, diagnose=False)
    v = _fired(run)["api_bound"]
    assert v.knob.startswith("--api-servers 4") and v.evidence["api_cpu_fraction"] == 0.96


def test_roofline_memory_bound_far_from_the_bound() -> None:
    fired = _fired(make_run(step_ms=60))
    assert set(fired) == {"roofline"}
    v = fired["roofline"]
    assert v.evidence["bound"] == "memory"
    assert v.evidence["percent_of_roofline"] == pytest.approx(100 * 18.68 / 60, abs=0.5)
    assert v.evidence["step_ms_bound"] == pytest.approx(18.7, abs=0.1)
    assert "memory-bound step at 31" in v.message


def test_roofline_compute_bound_prefill_heavy() -> None:
    # 16,384 tokens per step (1,024 of them sampled) is past the ridge
    run = make_run(tokens_per_step=16384, step_ms=400)
    v = _fired(run)["roofline"]
    assert v.evidence["bound"] == "compute" and "compute-bound" in v.message
    assert 20 < v.evidence["percent_of_roofline"] < 45
    assert "roofline" not in _fired(make_run(tokens_per_step=16384, step_ms=160))


def test_roofline_needs_known_ceilings() -> None:
    assert "roofline" not in _fired(make_run(step_ms=60, device_name="NVIDIA L4"))


def test_run_without_diagnostics_gets_the_bench_rules_only() -> None:
    run = make_run(client_cpu=0.95, diagnose=False)
    assert [v.rule for v in diagnose(run)] == ["client_bound"]
    assert any("no diagnostics" in line for line in summary_lines(run))


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="not a bench result"):
        diagnose({"output_throughput": 1})
    run = make_run()
    run["diagnostics"]["engine_timeline"]["stats"]["num_waiting"] = [0, 1]
    with pytest.raises(ValueError, match="num_waiting has 2 values"):
        diagnose(run)
    run = make_run()
    run["diagnostics"]["expert_load"]["tokens_per_expert"][3] = [1, 2]
    with pytest.raises(ValueError, match=r"tokens_per_expert\[3\] has 2 experts"):
        diagnose(run)


def test_verdict_round_trip_and_severity_check() -> None:
    v = diagnose(make_run(preemptions=3))[0]
    assert v.settings and Verdict.from_dict(v.to_dict()) == v
    old = {k: val for k, val in v.to_dict().items() if k != "settings"}  # a line from before
    assert Verdict.from_dict(old).settings == {}
    with pytest.raises(ValueError, match="severity"):
        Verdict("x", "fatal", "m", "k")


def test_oom_steps_names_the_lost_work_and_the_memory_knobs() -> None:
    """num_oom_steps grew during the run: critical, mem_fraction 0.05 lower on CUDA; quiet when
    it did not grow, no setting on a CPU engine."""
    n = 82  # the synthetic timeline's samples
    run = make_run(stats_extra={"num_oom_steps": [0] * 40 + [3] * (n - 40)})
    v = _fired(run)["oom_steps"]
    assert v.severity == "critical" and "3 forward steps ran out of device memory" in v.message
    assert "--mem-fraction lower" in v.knob and "--max-num-batched-tokens" in v.knob
    assert v.evidence == {"oom_steps": 3, "mem_fraction": 0.9}
    assert v.settings == {"mem_fraction": 0.85}
    assert "oom_steps" not in _fired(make_run(stats_extra={"num_oom_steps": [2] * n}))
    cpu = make_run(device="cpu", stats_extra={"num_oom_steps": [0] * 40 + [1] * (n - 40)})
    assert _fired(cpu)["oom_steps"].settings == {}
