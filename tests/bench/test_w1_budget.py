"""benchmarks/engine/w1_budget.py: a W1 run's time by step kind and part against its bound."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.engine.w1_budget import budget, describe, read_first


def _part(name: str, measured: float, bound: float | None) -> dict:
    return {"part": name, "measured_ms": measured, "bound_ms": bound}


def _run(graph: int = 100, steps: int = 110, duration: float = 5.0) -> dict:
    # 2 waves of 64 requests, 4,000 output tokens; serial bound 1,600 tok/s: 2.5 s
    return {"duration": duration, "total_output_tokens": 4000, "num_prompts": 128,
            "serial_bound": {"concurrency": 64, "output_tok_s": 1600.0, "prefill_s": 0.25,
                             "decode_s": 1.0},
            "engine_run": {"counters": {"num_forward_steps": steps, "num_graph_steps": graph}}}


def _profile(batch: int = 64) -> dict:
    decode = [_part("moe", 20.0, 15.0), _part("attention", 5.0, 4.0), _part("dense", 4.0, 3.0),
              _part("norm_rope", 1.0, None), _part("other", 0.0, None)]
    mixed = [_part("moe", 60.0, 40.0), _part("attention", 10.0, 5.0),
             _part("dense", 20.0, 18.0), _part("norm_rope", 5.0, None),
             _part("other", 5.0, None)]
    return {"batch": batch,
            "gpu_kernels_one_step": {"gpu_busy_ms": 30.0, "parts": {"parts": decode}},
            "mixed_step": {"wall_ms": [110.0, 108.0, 150.0], "parts": {"parts": mixed}}}


def test_steps_split_by_kind_against_the_bound_phases() -> None:
    b = budget(_run(), _profile(), target=60)
    decode, mixed = b["kinds"]["decode"], b["kinds"]["mixed"]
    assert decode["steps"] == 100 and mixed["steps"] == 10
    assert decode["seconds"] == pytest.approx(3.0)  # 100 graph steps x the profile's 30 ms
    assert mixed["seconds"] == pytest.approx(2.0)  # the rest of the 5 s run
    assert mixed["ms_per_step"] == pytest.approx(200.0)
    assert decode["bound_seconds"] == pytest.approx(2.0)  # 2 waves x decode_s
    assert mixed["bound_seconds"] == pytest.approx(0.5)  # 2 waves x prefill_s
    assert mixed["profile_wall_ms"] == 110.0 and mixed["profile_device_ms"] == 100.0
    assert b["run"]["percent_of_bound"] == pytest.approx(50.0)  # 800 of 1,600 tok/s
    # 60%: 4,000 tokens at 960 tok/s
    assert b["target"]["duration_s"] == pytest.approx(4000 / 960, abs=1e-3)
    assert b["target"]["save_s"] == pytest.approx(5.0 - 4000 / 960, abs=1e-3)


def test_losses_are_each_parts_excess_times_its_steps_largest_first() -> None:
    b = budget(_run(), _profile())
    by = {(r["kind"], r["part"]): r for r in b["losses"]}
    assert by[("decode", "moe")]["seconds"] == pytest.approx(0.5)  # 100 x 5 ms
    assert by[("mixed", "moe")]["seconds"] == pytest.approx(0.2)  # 10 x 20 ms
    assert by[("decode", "norm_rope")]["seconds"] == pytest.approx(0.1)  # unbounded: all of it
    assert not by[("decode", "norm_rope")]["bounded"]
    host = by[("mixed", "host (wall beyond device)")]
    assert host["per_step_ms"] == pytest.approx(10.0)  # the median wall 110 - device 100
    seconds = [r["seconds"] for r in b["losses"]]
    assert seconds == sorted(seconds, reverse=True)
    lost = 5.0 - 4000 / 1600
    assert b["run"]["lost_s"] == pytest.approx(lost)
    assert b["run"]["unattributed_s"] == pytest.approx(lost - sum(seconds), abs=1e-2)
    text = describe(b)
    assert "decode: 100 steps" in text and "mixed  moe" in text


def test_a_profile_at_another_batch_or_a_run_without_graph_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="batch 32"):
        budget(_run(), _profile(batch=32))
    with pytest.raises(ValueError, match="0 graph steps"):
        budget(_run(graph=0), _profile())
    run = _run()
    del run["serial_bound"]
    with pytest.raises(ValueError, match="serial_bound"):
        budget(run, _profile())


def test_reads_a_json_file_or_a_gzipped_json_lines_files_first_line(tmp_path) -> None:
    plain = tmp_path / "p.json"
    plain.write_text(json.dumps({"a": 1}, indent=1))
    lines = tmp_path / "r.jsonl.gz"
    with gzip.open(lines, "wt") as f:
        f.write(json.dumps({"b": 2}) + "\n" + json.dumps({"b": 3}) + "\n")
    assert read_first(str(plain)) == {"a": 1}
    assert read_first(str(lines)) == {"b": 2}
