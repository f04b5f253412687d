"""benchmarks/engine/split_runs.py: one committed JSON per run, request records dropped or
slimmed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.engine.split_runs import main


def _runs(path: Path, concurrencies: tuple[int, ...] = (4, 8)) -> None:
    runs = [{"max_concurrency": c, "completed": 2, "failed": 0, "output_throughput": 10.0 * c + i,
             "server_api_cpu_fraction": 0.5, "client_bound": False,
             "requests": [{"ttft": 0.1, "chunk_times": [0.1, 0.2, 0.3], "chunk_tokens": [1, 1, 1]},
                          {"ttft": 0.2, "chunk_times": [0.2], "chunk_tokens": [1]}]}
            for i, c in enumerate(concurrencies)]
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))


def test_requests_dropped_by_default_and_counted(tmp_path: Path) -> None:
    _runs(tmp_path / "runs.jsonl")
    main(str(tmp_path / "runs.jsonl"), str(tmp_path / "out"), "w1_x")
    for c in (4, 8):
        run = json.loads((tmp_path / "out" / f"w1_x_c{c}.json").read_text())
        assert "requests" not in run and run["num_request_records_dropped"] == 2
        assert run["output_throughput"] == 10.0 * c + (c == 8)  # the figures stay


def test_keep_requests_keeps_scalars_and_counts_chunks(tmp_path: Path) -> None:
    _runs(tmp_path / "runs.jsonl")
    main(str(tmp_path / "runs.jsonl"), str(tmp_path / "out"), "w1_x", keep_requests=True)
    run = json.loads((tmp_path / "out" / "w1_x_c4.json").read_text())
    assert run["requests"] == [{"ttft": 0.1, "num_chunks": 3}, {"ttft": 0.2, "num_chunks": 1}]


def test_a_repeated_concurrency_never_overwrites(tmp_path: Path) -> None:
    _runs(tmp_path / "runs.jsonl", (4, 4, 8, 4))
    main(str(tmp_path / "runs.jsonl"), str(tmp_path / "out"), "w1_x")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["w1_x_c4.json", "w1_x_c4_run2.json", "w1_x_c4_run3.json", "w1_x_c8.json"]
    throughput = {n: json.loads((tmp_path / "out" / n).read_text())["output_throughput"]
                  for n in names}
    assert throughput == {"w1_x_c4.json": 40.0, "w1_x_c4_run2.json": 41.0,
                          "w1_x_c4_run3.json": 43.0, "w1_x_c8.json": 82.0}
