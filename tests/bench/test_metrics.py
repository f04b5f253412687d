"""Every figure of metrics.py against values worked out by hand for a synthetic timeline.

The run lasts 10 s. Times of chunks are seconds after each request's start.

    request  start  chunks (time: tokens)                 E2E   usage out/in   success
    R0       0.0    0.5:1  1.0:1  1.5:1  2.2:1            2.3   4 / 10         yes
    R1       1.0    1.0:2  2.0:3  2.6:2                   3.0   - / -  (prompt_len 20)
    R2       2.0    0.25:1                                0.3   1 / 5          yes
    R3       0.0    0.1:100                               0.2   -              no  HTTP 500: boom
    R4       0.0    -                                     -     -              no  HTTP 500: boom
    R5       0.0    -                                     -     -              no  timeout

    output_len: R0 4 (usage), R1 7 (stream: no usage), R2 1      -> 12 tokens
    input:      R0 10 (usage), R1 20 (workload), R2 5            -> 35 tokens
    TTFT  [0.5, 1.0, 0.25]
    E2E   [2.3, 3.0, 0.3]
    TPOT  R0 (2.3 - 0.5) / 3 = 0.6, R1 (3.0 - 1.0) / 6 = 1/3, R2 excluded (output_len 1)
    ITL   R0 [0.5, 0.5, 0.7]; R1 [1/3, 1/3, 1/3] (gap 1.0 over 3 tokens), [0.3, 0.3] (0.6 / 2)
    arrivals (run time: tokens): 0.5:1 | 1.0:1 1.5:1 | 2.2:1 2.0:2 2.25:1 | 3.0:3 3.6:2
          -> 1-s bins [1, 2, 4, 5]; R3's 100 tokens (failed) are not counted
"""

from __future__ import annotations

import numpy as np
import pytest

from moeserve.bench.metrics import (
    compute_metrics,
    peak_output_throughput,
    request_itls,
    request_tpot,
    tokens_per_second_bins,
)
from moeserve.bench.records import RequestRecord

DURATION = 10.0
ms = 1000.0


def _timeline() -> list[RequestRecord]:
    def rec(i: int, plen: int, **kw: object) -> RequestRecord:
        return RequestRecord(index=i, prompt_len=plen, max_tokens=8, **kw)  # type: ignore[arg-type]

    return [
        rec(0, 10, success=True, status=200, start=0.0, ttft=0.5, latency=2.3,
            chunk_times=[0.5, 1.0, 1.5, 2.2], chunk_tokens=[1, 1, 1, 1],
            usage_prompt_tokens=10, usage_completion_tokens=4),
        rec(1, 20, success=True, status=200, start=1.0, ttft=1.0, latency=3.0,
            chunk_times=[1.0, 2.0, 2.6], chunk_tokens=[2, 3, 2]),
        rec(2, 99, success=True, status=200, start=2.0, ttft=0.25, latency=0.3,
            chunk_times=[0.25], chunk_tokens=[1], usage_prompt_tokens=5,
            usage_completion_tokens=1),
        rec(3, 10, success=False, status=500, error="HTTP 500: boom", start=0.0, ttft=0.1,
            latency=0.2, chunk_times=[0.1], chunk_tokens=[100]),
        rec(4, 10, success=False, status=500, error="HTTP 500: boom"),
        rec(5, 10, success=False, error="timeout: no complete response"),
    ]


def test_counts_and_throughputs() -> None:
    m = compute_metrics(_timeline(), DURATION)
    assert (m.completed, m.failed) == (3, 3)
    assert m.total_input_tokens == 35 and m.total_output_tokens == 12
    assert m.total_streamed_tokens == 12 and m.usage_mismatches == 0
    assert m.request_throughput == pytest.approx(0.3)
    assert m.input_throughput == pytest.approx(3.5)
    assert m.output_throughput == pytest.approx(1.2)
    assert m.total_throughput == pytest.approx(4.7)
    assert m.concurrency == pytest.approx((2.3 + 3.0 + 0.3) / 10)  # achieved: sum(E2E) / dur
    assert m.duration == DURATION


def test_ttft_and_e2e() -> None:
    m = compute_metrics(_timeline(), DURATION)
    assert m.mean_ttft_ms == pytest.approx(1.75 / 3 * ms)
    assert m.median_ttft_ms == pytest.approx(500.0)
    assert m.std_ttft_ms == pytest.approx(np.sqrt(0.2916667 / 3) * ms, rel=1e-5)
    assert m.p99_ttft_ms == pytest.approx((0.5 + 0.98 * 0.5) * ms)  # linear, rank 1.98
    assert m.mean_e2e_latency_ms == pytest.approx(5.6 / 3 * ms)
    assert m.median_e2e_latency_ms == pytest.approx(2300.0)
    assert m.p99_e2e_latency_ms == pytest.approx((2.3 + 0.98 * 0.7) * ms)


def test_tpot_excludes_single_token_outputs() -> None:
    recs = _timeline()
    assert request_tpot(recs[0]) == pytest.approx(0.6)
    assert request_tpot(recs[1]) == pytest.approx(1 / 3)
    assert request_tpot(recs[2]) is None
    m = compute_metrics(recs, DURATION)
    assert m.mean_tpot_ms == pytest.approx((0.6 + 1 / 3) / 2 * ms)
    assert m.median_tpot_ms == pytest.approx((0.6 + 1 / 3) / 2 * ms)
    assert m.std_tpot_ms == pytest.approx((0.6 - 1 / 3) / 2 * ms)
    assert m.p99_tpot_ms == pytest.approx((1 / 3 + 0.99 * (0.6 - 1 / 3)) * ms)


def test_itl_splits_multi_token_chunks() -> None:
    recs = _timeline()
    assert request_itls(recs[0]) == pytest.approx([0.5, 0.5, 0.7])
    assert request_itls(recs[1]) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.3, 0.3])
    assert request_itls(recs[2]) == []
    m = compute_metrics(recs, DURATION)
    # all gaps sorted: 0.3 0.3 1/3 1/3 1/3 0.5 0.5 0.7
    assert m.mean_itl_ms == pytest.approx(3.3 / 8 * ms)
    assert m.median_itl_ms == pytest.approx(1 / 3 * ms)
    assert m.p95_itl_ms == pytest.approx((0.5 + 0.65 * 0.2) * ms)  # rank 6.65
    assert m.p99_itl_ms == pytest.approx((0.5 + 0.93 * 0.2) * ms)  # rank 6.93
    assert m.max_itl_ms == pytest.approx(700.0)


def test_itl_skips_chunks_without_tokens() -> None:
    # a text-only chunk (0 tokens) at 1.2 adds no gap; the next gap runs from the last tokens
    r = RequestRecord(index=0, prompt_len=1, max_tokens=3, success=True,
                      chunk_times=[1.0, 1.2, 2.0, 2.5], chunk_tokens=[1, 0, 1, 1])
    assert request_itls(r) == pytest.approx([1.0, 0.5])


def test_peak_throughput_bins() -> None:
    recs = _timeline()
    assert tokens_per_second_bins(recs) == [1, 2, 4, 5]
    assert peak_output_throughput(recs) == 5.0
    assert compute_metrics(recs, DURATION).peak_output_throughput == 5.0
    assert tokens_per_second_bins(recs, bin_s=2.0) == [3, 9]  # [0, 2): 3; [2, 4): 9
    assert peak_output_throughput(recs, bin_s=2.0) == 4.5


def test_failed_requests_listed_with_errors() -> None:
    m = compute_metrics(_timeline(), DURATION)
    assert m.errors == (("HTTP 500: boom", 2), ("timeout: no complete response", 1))
    assert m.to_dict()["errors"] == [{"error": "HTTP 500: boom", "count": 2},
                                     {"error": "timeout: no complete response", "count": 1}]


def test_usage_mismatch_counted_and_usage_wins() -> None:
    r = RequestRecord(index=0, prompt_len=4, max_tokens=3, success=True, latency=1.0,
                      ttft=0.1, chunk_times=[0.1, 0.5], chunk_tokens=[1, 1],
                      usage_completion_tokens=3)
    m = compute_metrics([r], 2.0)
    assert m.usage_mismatches == 1
    assert m.total_output_tokens == 3 and m.total_streamed_tokens == 2


def test_all_failed_gives_zeros_not_nan() -> None:
    m = compute_metrics(_timeline()[3:], DURATION)
    assert m.completed == 0 and m.failed == 3
    figures = [v for k, v in m.to_dict().items() if k != "errors"]
    assert all(np.isfinite(v) for v in figures)
    assert m.mean_ttft_ms == 0.0 and m.peak_output_throughput == 0.0


def test_bad_duration() -> None:
    with pytest.raises(ValueError, match="duration must be > 0"):
        compute_metrics(_timeline(), 0.0)


def test_record_json_round_trip() -> None:
    r = _timeline()[1]
    d = r.to_dict()
    assert d["output_len"] == 7 and d["streamed_tokens"] == 7
    back = RequestRecord.from_dict(d)
    assert back == r
