"""`moeserve bench`: an async load generator for OpenAI-compatible servers.

    workloads.py  requests to send (random ids or text, ShareGPT file, shared prefix)
    client.py     one streaming request, timed, into a RequestRecord (records.py)
    runner.py     warm-up, arrivals, concurrency cap, client processes, client CPU
    metrics.py    figures from the records, defined as sglang's bench_serving defines them
    report.py     JSON lines, terminal tables, progress bar
    server.py     the server the bench starts itself; /v1/engine, /v1/models; git commit
    cli.py        flags (`add_bench_args`) and the sweep (`run_bench`)
"""

from __future__ import annotations

from moeserve.bench.cli import add_bench_args, run_bench
from moeserve.bench.metrics import BenchMetrics, compute_metrics
from moeserve.bench.records import RequestRecord

__all__ = ["BenchMetrics", "RequestRecord", "add_bench_args", "compute_metrics", "run_bench"]
