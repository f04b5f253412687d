"""Diagnose: what bound a benchmark run, and which knob moves it.

    telemetry.py    samplers: NVML (power, SM clock, utilisation, memory) and the server's
                    processes' CPU (psutil), on background threads
    figures.py      figures read out of a bench run object (its `diagnostics` part documented
                    there): engine timeline, steady window, GPU and process figures
    expert_load.py  the engine's tokens-per-expert counters: run delta, mean per step, imbalance
    bounds/         what a step could cost at best: roofline.py (bytes and FLOPs of a step
                    from the model shape; the H200's and H100's ceilings; the share of the
                    bound a run reached),
                    step_parts.py (a profiled step's parts against their bounds), kv_bound.py
                    (the throughput a fixed-length run's KV cache allows)
    doctor.py       the rules: run -> [Verdict(rule, severity, message, knob, evidence,
                    settings)]; host_rules.py the host's (client, API, engine loop, CPU threads);
                    verdict.py the Verdict (settings: engine config fields for a tuner)
    plots.py        matplotlib PNGs; report.py: markdown report and run-against-run config diff
    cli.py          `moeserve doctor` and `moeserve report`

Data flow: `moeserve bench --diagnose` (bench/diagnostics.py) samples during each timed run,
stores `diagnostics` and the doctor's `verdicts` in the run's JSON line; `moeserve doctor` and
`moeserve report` read those lines back.
"""

from __future__ import annotations

from moeserve.diagnose.doctor import Verdict, diagnose

__all__ = ["Verdict", "diagnose"]
