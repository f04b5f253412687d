"""Synthetic bench run objects for the doctor's and the report's tests.

`make_run()` with no arguments is a healthy W1 run at concurrency 1,024 on an H200 serving
qwen3-30b-a3b: the auto cap (1,935) above the batch, KV at 40%, no preemption, CUDA graphs on,
64 tokens per expert per step, 550 of 700 W at 97% utilisation, 25 ms per step (75% of the
18.7 ms roofline bound), client, API and engine processes below saturation (the engine's CUDA
sync spins at 100% of a core, as it does on a busy GPU). Each argument breaks one figure.
"""

from __future__ import annotations

import copy
from typing import Any

from moeserve.bench.engine_run import engine_run

H200 = "NVIDIA H200"
CUDA_GRAPHS_ON = "on: 52 batch sizes up to 1935"


def _engine_config(cap_setting: int | str, device: str, **knobs: Any) -> dict[str, Any]:
    cfg = {"model": "qwen3-30b-a3b", "tokenizer": None, "device": device, "dtype": "bfloat16",
           "load_format": "dummy", "moe_backend": "grouped_mm", "attention_backend": "torch",
           "seed": 0, "async_scheduling": True,
           "cache": {"block_size": 16, "mem_fraction": 0.9, "cpu_kv_cache_bytes": 268435456,
                     "num_blocks": None, "enable_prefix_caching": True},
           "scheduler": {"max_num_batched_tokens": 8192, "max_running_requests": cap_setting,
                         "request_pool": 4096, "expected_tokens_per_request": 256,
                         "max_model_len": 4096, "enable_chunked_prefill": True,
                         "watermark": 0.01}}
    for dotted, value in knobs.items():
        *path, leaf = dotted.split("__")
        node = cfg
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def _timeline(duration: float, running: int, waiting: int, step_ms: float,
              tokens_per_step: float, generated_per_step: float, preemptions: int,
              kv_usage: float, extra: dict[str, list[float]] | None) -> dict[str, Any]:
    t = [round(-0.05 + 0.25 * i, 3) for i in range(int(duration / 0.25) + 2)]
    n = len(t)
    steps_per_sample = 250.0 / step_ms
    stats: dict[str, list[Any]] = {
        "num_running": [0] + [running] * (n - 1),
        "num_waiting": [0] + [waiting] * (n - 1),
        "kv_usage": [0.0] + [kv_usage] * (n - 1),
        "num_steps": [round(i * steps_per_sample, 3) for i in range(n)],
        "num_generated_tokens": [round(i * steps_per_sample * generated_per_step) for i in
                                 range(n)],
        "num_prompt_tokens": [round(i * steps_per_sample * (tokens_per_step - generated_per_step))
                              for i in range(n)],
        "num_preemptions": [0] * (n - 1) + [preemptions],
        "step_seconds": [step_ms / 1e3] * n,
    }
    stats.update(extra or {})
    return {"available": True, "reason": None, "interval_s": 0.25, "t": t, "stats": stats,
            "errors": 0}


def _gpu(duration: float, powers: list[float], utils: list[float], limit: float
         ) -> dict[str, Any]:
    t = [round(0.1 * i, 3) for i in range(int(duration / 0.1) + 1)]
    devices = [{"index": i, "name": H200, "power_limit_w": limit, "memory_total_mib": 143771.0,
                "power_w": [p] * len(t), "sm_clock_mhz": [1980.0] * len(t),
                "util_pct": [u] * len(t), "memory_used_mib": [130000.0 if u else 500.0] * len(t)}
               for i, (p, u) in enumerate(zip(powers, utils))]
    return {"available": True, "reason": None, "interval_s": 0.1, "t": t, "devices": devices}


def make_run(*, conc: int | None = 1024, cap: int = 1935, cap_setting: int | str = "auto",
             running: int = 1024, waiting: int = 0, step_ms: float = 25.0,
             tokens_per_step: float | None = None, preemptions: int = 0, kv_usage: float = 0.4,
             power: float = 550.0, limit: float = 700.0, util: float = 97.0,
             idle_gpus: int = 0, engine_cpu: float = 1.0, api_cpu: float = 0.5,
             client_cpu: float = 0.3, cuda_graphs: str = CUDA_GRAPHS_ON,
             expert_tpe: float | None = 64.0, device: str = "cuda", device_name: str = H200,
             duration: float = 20.0, kv_tokens: int = 495488, api_servers: int = 1,
             stats_extra: dict[str, list[float]] | None = None, diagnose: bool = True,
             counters: dict[str, float] | None = None, capacity_extra: dict | None = None,
             **knobs: Any) -> dict[str, Any]:
    """A bench run object (see the module docstring); `knobs` set engine_config fields by
    path, e.g. cache__mem_fraction=0.8. `counters`: the engine counters' growth over the run
    (run["engine_run"], with its derived figures, as bench/engine_run.py makes it);
    `capacity_extra`: more capacity report fields."""
    tokens = float(running if tokens_per_step is None else tokens_per_step)
    run: dict[str, Any] = {
        "schema": "moeserve.bench/1", "max_concurrency": conc, "request_rate": "inf",
        "num_prompts": 3 * (conc or 1024), "completed": 3 * (conc or 1024), "failed": 0,
        "duration": duration, "output_throughput": 40000.0, "total_throughput": 80000.0,
        "peak_output_throughput": 45000.0, "median_ttft_ms": 300.0, "p99_ttft_ms": 900.0,
        "median_tpot_ms": step_ms, "p99_tpot_ms": step_ms * 1.3, "concurrency": conc or 1024,
        "total_input_tokens": 128 * 3 * (conc or 1024),
        "total_output_tokens": 128 * 3 * (conc or 1024),
        "client": [{"worker": 0, "num_requests": 3072, "cpu_seconds": client_cpu * duration,
                    "wall_seconds": duration, "cpu_fraction": client_cpu}],
        "client_bound": client_cpu > 0.9, "warnings": [],
        "config": {"input_len": 128, "output_len": 128, "workload": "random"},
        "server": {"started_by_bench": True},
        "engine": {
            "capacity_report": {
                "model": "qwen3-30b-a3b", "device_name": device_name,
                "engine_config": _engine_config(cap_setting, device, **knobs),
                "kv_tokens": kv_tokens, "max_running_requests": cap,
                "max_running_requests_rule": "auto: ...", "cuda_graphs": cuda_graphs},
            "stats": {},
            "server": {"api_servers": api_servers, "max_running_requests": cap}},
        "engine_run": None,
        "device": device_name, "server_api_cpu_fraction": api_cpu * api_servers,
    }
    run["engine"]["capacity_report"].update(capacity_extra or {})
    if counters is not None:
        run["engine_run"] = engine_run(dict.fromkeys(counters, 0), counters, duration)
    if not diagnose:
        return run
    generated = float(min(running, tokens))
    load = None
    if expert_tpe is not None:
        steps = round(duration * 1e3 / step_ms)
        load = {"num_steps": steps,
                "tokens_per_expert": [[round(expert_tpe * steps)] * 128 for _ in range(48)]}
    procs = [{"pid": 100 + i, "role": "api", "cpu_fraction": [api_cpu] * 200}
             for i in range(api_servers)]
    procs.append({"pid": 99, "role": "engine", "cpu_fraction": [engine_cpu] * 200})
    run["diagnostics"] = {
        "schema": "moeserve.diagnostics/1",
        "engine_timeline": _timeline(duration, running, waiting, step_ms, tokens, generated,
                                     preemptions, kv_usage, stats_extra),
        "gpu": _gpu(duration, [power] + [60.0] * idle_gpus, [util] + [0.0] * idle_gpus, limit),
        "cpu": {"available": True, "reason": None, "interval_s": 0.1,
                "t": [round(0.1 * (i + 1), 3) for i in range(200)], "processes": procs},
        "expert_load": load,
    }
    return run


def variant(run: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(run)
    out.update(changes)
    return out
