"""Results out: the JSON line of a run, the terminal tables, the progress bar.

One run -> `build_result` -> one JSON object (appended as a line to --output-json):
    identity      schema, timestamp, max_concurrency, request_rate, num_prompts, ...
    figures       every `BenchMetrics` field, under bench_serving's names, at the top level
    client        each client process's CPU use; client_bound and the warnings
    provenance    config (the bench's flags), server (url, model, engine = GET /v1/engine or
                  null), device, git_commit
    requests      the per-request records (records.py), in workload order
The same object feeds `print_run` (a bench_serving-style summary) and `print_sweep` (one row
per run).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moeserve.bench.metrics import BenchMetrics
from moeserve.bench.runner import CLIENT_BOUND_CPU, RunResult

SCHEMA = "moeserve.bench/1"
CLIENT_BOUND_MESSAGE = ("client-bound: the client, not the server, may be the limit "
                        "(a client process used > {:.0%} of a core); use --workers")


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def build_result(metrics: BenchMetrics, run: RunResult, *, max_concurrency: int | None,
                 request_rate: float, config: dict[str, Any], server: dict[str, Any],
                 engine: Any | None, device: Any | None, git: dict[str, Any],
                 warnings: Sequence[str]) -> dict[str, Any]:
    """The JSON object of one run (see the module docstring for its parts)."""
    warnings = list(warnings)
    if run.client_bound:
        warnings.append(CLIENT_BOUND_MESSAGE.format(CLIENT_BOUND_CPU))
    if metrics.usage_mismatches:
        warnings.append(f"{metrics.usage_mismatches} requests: tokens counted in the stream != "
                        f"the server's usage.completion_tokens")
    return {
        "schema": SCHEMA,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "max_concurrency": max_concurrency,
        "request_rate": _json_rate(request_rate),
        "num_prompts": len(run.records),
        **metrics.to_dict(),
        "client": [{"worker": p.worker, "num_requests": p.num_requests,
                    "cpu_seconds": p.cpu_seconds, "wall_seconds": p.wall_seconds,
                    "cpu_fraction": p.cpu_fraction} for p in run.processes],
        "client_bound": run.client_bound,
        "warnings": warnings,
        "config": config,
        "server": server,
        "engine": engine,
        "device": device,
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
        "requests": [r.to_dict() for r in run.records],
    }


def append_jsonl(path: str | Path, result: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(result) + "\n")


_STAT_NAMES = {"mean": "Mean", "median": "Median", "p95": "P95", "p99": "P99", "max": "Max"}


def _rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    conc = res["max_concurrency"] if res["max_concurrency"] is not None else "not set"
    rows = [
        ("Traffic request rate", str(res["request_rate"])),
        ("Max request concurrency", str(conc)),
        ("Successful requests", str(res["completed"])),
        ("Failed requests", str(res["failed"])),
        ("Benchmark duration (s)", f"{res['duration']:.2f}"),
        ("Total input tokens", str(res["total_input_tokens"])),
        ("Total generated tokens", str(res["total_output_tokens"])),
        ("Request throughput (req/s)", f"{res['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{res['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{res['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s)", f"{res['peak_output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{res['total_throughput']:.2f}"),
        ("Concurrency (achieved)", f"{res['concurrency']:.2f}"),
    ]
    for title, key, stats in (("E2E Latency", "e2e_latency", ("mean", "median", "p99")),
                              ("TTFT", "ttft", ("mean", "median", "p99")),
                              ("TPOT", "tpot", ("mean", "median", "p99")),
                              ("ITL", "itl", ("mean", "median", "p95", "p99", "max"))):
        rows += [(f"{_STAT_NAMES[s]} {title} (ms)", f"{res[f'{s}_{key}_ms']:.2f}")
                 for s in stats]
    cpu = ", ".join(f"{c['cpu_fraction']:.0%}" for c in res["client"])
    rows.append(("Client CPU per process", cpu))
    return rows


def print_run(console: Console, res: dict[str, Any]) -> None:
    """bench_serving's summary, as a table, then the errors and warnings."""
    table = Table(title="Serving Benchmark Result", show_header=False, title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in _rows(res):
        table.add_row(name, value)
    console.print(table)
    for e in res["errors"]:
        console.print(f"[red]error ({e['count']} requests):[/red] {e['error']}",
                      highlight=False, markup=True)
    for w in res["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)


def print_sweep(console: Console, results: Sequence[dict[str, Any]]) -> None:
    """One row per run of a sweep."""
    table = Table(title="Sweep (latencies in ms, throughputs per second)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ("max\nconc", "req/s", "output\ntok/s", "peak\ntok/s", "TTFT\np50", "TTFT\np99",
            "TPOT\np50", "TPOT\np99", "achieved\nconc", "failed", "client\nCPU")
    for c in cols:
        table.add_column(c, justify="right", no_wrap=True)
    for r in results:
        cpu = max(c["cpu_fraction"] for c in r["client"])
        table.add_row(str(r["max_concurrency"]), f"{r['request_throughput']:.1f}",
                      f"{r['output_throughput']:.0f}", f"{r['peak_output_throughput']:.0f}",
                      f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}",
                      f"{r['median_tpot_ms']:.1f}", f"{r['p99_tpot_ms']:.1f}",
                      f"{r['concurrency']:.1f}", str(r["failed"]),
                      f"{cpu:.0%}" + (" bound" if r["client_bound"] else ""))
    console.print(table)


@contextmanager
def progress_bar(console: Console, total: int, description: str,
                 enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar; yields a callback taking the number of requests finished."""
    if not enabled:
        yield lambda done: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda done: progress.update(task, completed=done)
