"""benchmarks/quant/quant_compare.py: medians per format and concurrency, the ratio to bf16,
issue 18's W1 targets, and runs that did not hold their concurrency marked as held back."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.quant.quant_compare import load_runs, summarise


def write_run(folder: Path, name: str, tok_s: float, mean_conc: float | None,
              bound: float = 30000.0) -> None:
    run = {"output_throughput": tok_s, "completed": 100, "failed": 0, "median_tpot_ms": 20.0,
           "serial_bound": {"output_tok_s": bound, "weights": "nvfp4", "percent": None},
           "engine": {"capacity_report": {"moe_configs": {}}}}
    if mean_conc is not None:
        run["concurrency"] = mean_conc
    (folder / name).write_text(json.dumps(run))


def test_ratios_targets_and_held_back_runs(tmp_path: Path) -> None:
    write_run(tmp_path, "w1_bf16_c1024.json", 9400.0, 859.4)  # the H100's cache-bound bf16
    write_run(tmp_path, "w1_nvfp4_c1024.json", 17500.0, 1010.0)
    write_run(tmp_path, "w1_nvfp4_c256_run1.json", 10000.0, 254.0)
    write_run(tmp_path, "w1_nvfp4_c256_run2.json", 11000.0, 250.0)
    write_run(tmp_path, "w1_nvfp4_c256_run3.json", 12000.0, None)  # an older bench's JSON
    write_run(tmp_path, "notes.json", 1.0, 1.0)  # not a run's name: skipped
    rows = {(r["format"], r["concurrency"]): r for r in summarise(load_runs(str(tmp_path)))}
    assert set(rows) == {("bf16", 1024), ("nvfp4", 1024), ("nvfp4", 256)}
    bf16, nvfp4 = rows[("bf16", 1024)], rows[("nvfp4", 1024)]
    assert bf16["held_back"] and bf16["mean_concurrency"] == 859.4
    assert not nvfp4["held_back"] and nvfp4["x_bf16_base_held_back"]
    assert nvfp4["x_bf16"] == round(17500 / 9400, 3) and nvfp4["pass"]  # 1.3x target
    at256 = rows[("nvfp4", 256)]
    assert at256["runs"] == 3 and at256["output_tok_s"] == 11000.0  # the median
    assert at256["mean_concurrency"] == 252.0 and not at256["held_back"]
    assert at256["target"] == {"percent_of_bound": 60} and not at256["pass"]  # 36.7%
    assert "x_bf16" not in at256  # no bf16 run at 256
