"""Benchmark figures from per-request records: pure functions, bench_serving's definitions.

Input: the `RequestRecord`s of one timed run and its `duration` (wall time from the first send
to the last response). Output: `BenchMetrics`, with the field names sglang's bench_serving
writes to its JSON lines, so a number from either tool means the same thing:

    over successful requests only (failed ones are counted and their errors listed):
    request_throughput  = completed / duration
    output_throughput   = sum(output_len) / duration     (output_len = usage.completion_tokens)
    total_throughput    = (sum(prompt tokens) + sum(output_len)) / duration
    TPOT per request    = (E2E - TTFT) / (output_len - 1), requests with output_len > 1
    ITL                 = gaps between content chunks; a chunk of n tokens adds n gaps of gap/n
    concurrency         = sum(E2E) / duration                  (achieved concurrency)
    peak_output_throughput = most stream tokens arriving in one 1-second bin of the run
                            (bins from the run's start; a chunk's tokens all at its arrival)

Means, medians, standard deviations and percentiles are numpy's (`np.percentile`, linear
method), and an empty list gives 0, as in bench_serving.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moeserve.bench.records import RequestRecord


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    """Every figure of one run. Latencies in milliseconds, throughputs per second."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input_tokens: int
    total_output_tokens: int  # sum of output_len (the server's usage when it gives one)
    total_streamed_tokens: int  # sum of tokens counted from the stream by the client
    usage_mismatches: int  # successful requests whose stream count != usage.completion_tokens
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    peak_output_throughput: float
    concurrency: float  # achieved: sum(E2E) / duration
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    errors: tuple[tuple[str, int], ...]  # (message, count), most frequent first

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["errors"] = [{"error": msg, "count": n} for msg, n in self.errors]
        return d


def request_itls(record: RequestRecord) -> list[float]:
    """Inter-token latencies of one request, in seconds.

    The first content chunk sets TTFT and adds no gap, whatever its token count (as in
    bench_serving). Each later chunk of n > 0 tokens adds n gaps of (its time - the previous
    token chunk's time) / n; a chunk with text but no tokens adds none.
    """
    itls: list[float] = []
    times, counts = record.chunk_times, record.chunk_tokens
    if not times:
        return itls
    last = times[0]
    for t, n in zip(times[1:], counts[1:]):
        if n <= 0:
            continue
        itls.extend([(t - last) / n] * n)
        last = t
    return itls


def request_tpot(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output_len - 1), or None when output_len <= 1."""
    if record.output_len <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_len - 1)


def tokens_per_second_bins(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[int]:
    """Stream tokens of successful requests per `bin_s` bin, from the run's start (time 0)."""
    counts: Counter[int] = Counter()
    for r in records:
        if not r.success:
            continue
        for t, n in zip(r.chunk_times, r.chunk_tokens):
            counts[math.floor((r.start + t) / bin_s)] += n
    if not counts:
        return []
    first, last = min(min(counts), 0), max(counts)
    return [counts.get(b, 0) for b in range(first, last + 1)]


def peak_output_throughput(records: Sequence[RequestRecord], bin_s: float = 1.0) -> float:
    """The most stream tokens that arrived in any one `bin_s` bin, per second."""
    bins = tokens_per_second_bins(records, bin_s)
    return max(bins) / bin_s if bins else 0.0


def error_counts(records: Sequence[RequestRecord]) -> tuple[tuple[str, int], ...]:
    """Failed requests' errors, counted by message, most frequent first."""
    counts = Counter(r.error or "unknown error" for r in records if not r.success)
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _stats_ms(values: list[float], percentiles: Sequence[int]) -> list[float]:
    """mean, median, std, then the percentiles, in ms; an empty list gives zeros."""
    arr = np.asarray(values or [0.0], dtype=np.float64)
    out = [arr.mean(), np.median(arr), arr.std()] + [np.percentile(arr, p) for p in percentiles]
    return [float(v) * 1000.0 for v in out]


def compute_metrics(records: Sequence[RequestRecord], duration: float) -> BenchMetrics:
    """All figures of a run. Raises ValueError for a non-positive duration."""
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    e2es = [r.latency for r in ok]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    itls = [g for r in ok for g in request_itls(r)]
    ttft = _stats_ms(ttfts, [99])
    tpot = _stats_ms(tpots, [99])
    itl = _stats_ms(itls, [95, 99, 100])
    e2e = _stats_ms(e2es, [99])
    mismatches = sum(1 for r in ok if r.usage_completion_tokens is not None
                     and r.usage_completion_tokens != r.streamed_tokens)
    return BenchMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration=duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        total_streamed_tokens=sum(r.streamed_tokens for r in ok), usage_mismatches=mismatches,
        request_throughput=len(ok) / duration, input_throughput=total_in / duration,
        output_throughput=total_out / duration, total_throughput=(total_in + total_out) / duration,
        peak_output_throughput=peak_output_throughput(ok), concurrency=sum(e2es) / duration,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], std_ttft_ms=ttft[2], p99_ttft_ms=ttft[3],
        mean_tpot_ms=tpot[0], median_tpot_ms=tpot[1], std_tpot_ms=tpot[2], p99_tpot_ms=tpot[3],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], std_itl_ms=itl[2], p95_itl_ms=itl[3],
        p99_itl_ms=itl[4], max_itl_ms=itl[5],
        mean_e2e_latency_ms=e2e[0], median_e2e_latency_ms=e2e[1], std_e2e_latency_ms=e2e[2],
        p99_e2e_latency_ms=e2e[3], errors=error_counts(records),
    )
