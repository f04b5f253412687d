"""benchmarks/parallel/scaling_summary.py (issue 20's scaling table) over hand-made bench results:
per-GPU throughput against one GPU's at the same streams per GPU, the collectives' share of the
step (the doctor's: the engine samples' means in the run), a run appended twice read at its
last result, other files skipped, and a broken result named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.parallel.scaling_summary import load_runs, table


def write(folder: Path, name: str, tok_s: float, comm: list[float] | None = None,
          step: list[float] | None = None, lines: int = 1) -> None:
    """A bench result; comm / step: the engine timeline's samples (a --diagnose run), the
    last one past the run's 30 s (not counted)."""
    result = {"output_throughput": tok_s, "completed": 10, "failed": 0, "client_bound": False,
              "server_api_cpu_fraction": 0.25, "duration": 30.0}
    if step is not None:
        result["diagnostics"] = {"engine_timeline": {
            "t": [1.0 + 20 * i for i in range(len(step))],
            "stats": {"comm_seconds": comm, "eager_step_seconds": step}}}
    stale = dict(result, output_throughput=1.0)
    text = [json.dumps(stale)] * (lines - 1) + [json.dumps(result)]
    (folder / name).write_text("\n".join(text) + "\n")


def test_per_gpu_ratio_and_comm_share(tmp_path: Path) -> None:
    write(tmp_path, "w1_tp_w1_c1024.jsonl", 20_000.0)
    write(tmp_path, "w1_tp_w2_c2048.jsonl", 36_000.0, comm=[0.001, 0.003, 0.5],
          step=[0.02, 0.02, 0.03], lines=2)  # means 2 of 20 ms in the run
    write(tmp_path, "w1_ep_w2_c4096.jsonl", 50_000.0)  # 2,048 a GPU: no W 1 run to compare
    (tmp_path / "comm_bandwidth.json").write_text("{}")
    (tmp_path / "w1_tp_w2_c2048.log").write_text("a log")
    runs = load_runs(tmp_path)
    assert [(r.mode, r.world, r.streams) for r in runs] == [
        ("ep", 2, 4096), ("tp", 1, 1024), ("tp", 2, 2048)]
    two = next(r for r in runs if r.mode == "tp" and r.world == 2)
    assert two.per_gpu_streams == 1024 and two.per_gpu_tok_s == 18_000.0
    assert two.comm_share == pytest.approx(0.1)
    lines = table(runs).splitlines()
    assert len(lines) == 4
    tp2 = next(ln for ln in lines if ln.startswith("tp     2"))
    assert " 0.90 " in tp2 and "10.0%" in tp2  # 18,000 against 20,000 a GPU
    ep2 = next(ln for ln in lines if ln.startswith("ep"))
    assert ep2.split()[6] == "-" and ep2.split()[7] == "-"  # no baseline, no profile


def test_a_broken_result_is_named(tmp_path: Path) -> None:
    (tmp_path / "w1_tp_w1_c1024.jsonl").write_text('{"completed": 3}\n')
    with pytest.raises(ValueError, match="w1_tp_w1_c1024.jsonl: not a moeserve bench result"):
        load_runs(tmp_path)
