"""The runner: arrival process, concurrency cap, client processes, warm-up, client-bound flag.

Arrival times are checked on a fake clock (`FakeClock`), concurrency through the records' own
timestamps and the test server's `gather`, never against the wall clock."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from moeserve.bench.client import ClientConfig
from moeserve.bench.metrics import compute_metrics
from moeserve.bench.report import build_result
from moeserve.bench.runner import (
    ProcessStats,
    RunConfig,
    RunResult,
    arrival_offsets,
    run_async,
    run_process,
    run_timed,
    split_evenly,
    warmup,
)
from moeserve.bench.workloads import WorkItem
from tests.bench.fake_server import FakeServer


def _items(n: int, out: int = 4) -> list[WorkItem]:
    return [WorkItem([i, i + 1], 2, out) for i in range(n)]


def _client(server: FakeServer) -> ClientConfig:
    return ClientConfig(base_url=server.url, model="fake-model", timeout_s=20)


class FakeClock:
    """`clock` and `sleep` for run_process: time moves only when the runner sleeps, once the
    requests already released have been sent (they run up to their first await)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0)
        self.now += seconds


def _fake_clock_run(server: FakeServer, n: int, rate: float) -> tuple[FakeClock, list[float]]:
    """The send times of a run of n one-token requests at `rate`, on a FakeClock."""
    fake = FakeClock()
    records, _, _ = run_async(run_process(_client(server), _items(n, out=1), list(range(n)),
                                          None, rate, 1.0, 3, clock=fake.clock,
                                          sleep=fake.sleep))
    assert all(r.success for r in records)
    return fake, [r.start for r in records]


def _max_overlap(records: list) -> int:
    """The most requests in flight at once on the client's clock, from start to last line
    (1 us of rounding allowed where one request's end meets the next one's start)."""
    spans = [(r.start, r.start + r.latency) for r in records]
    return max(sum(a <= s < b - 1e-6 for a, b in spans) for s, _ in spans)


def test_rate_inf_sends_all_at_zero() -> None:
    assert arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 5


def test_poisson_mean_gap_and_gamma_burstiness() -> None:
    rate, n = 4.0, 40_000
    offs = arrival_offsets(n, rate, 1.0, np.random.default_rng(0))
    gaps = np.diff(offs)
    assert offs[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    bursty = np.diff(arrival_offsets(n, rate, 0.25, np.random.default_rng(1)))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.05)  # same rate ...
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1/sqrt(0.25)


def test_split_evenly() -> None:
    assert [split_evenly(10, 3, i) for i in range(3)] == [4, 3, 3]
    assert sum(split_evenly(2048, 7, i) for i in range(7)) == 2048


def test_run_config_errors() -> None:
    with pytest.raises(ValueError, match="--max-concurrency must be >= 1"):
        RunConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        RunConfig(request_rate=0)
    with pytest.raises(ValueError, match="--burstiness must be > 0"):
        RunConfig(burstiness=0)
    with pytest.raises(ValueError, match="--workers 4 > --max-concurrency 2"):
        RunConfig(max_concurrency=2, num_workers=4)


def test_concurrency_cap_holds(fake_server: FakeServer) -> None:
    fake_server.state.options.delay_s = 0.01
    fake_server.state.options.gather = 3  # the first 3 stream only once all 3 are in flight
    seen: list[int] = []
    run = run_timed(_client(fake_server), _items(24), RunConfig(max_concurrency=3),
                    on_progress=seen.append)
    assert fake_server.state.max_in_flight == 3  # reached, never exceeded
    assert all(r.success for r in run.records) and [r.index for r in run.records] == list(
        range(24))
    assert seen == list(range(1, 25))
    assert run.duration > 0 and len(run.processes) == 1
    # the cap queues requests in the client, outside their TTFT: a request's clock starts
    # when it gets a slot, so no more than 3 are ever between start and last line
    assert _max_overlap(run.records) == 3
    m = compute_metrics(run.records, run.duration)
    assert m.concurrency <= 3.0 + 1e-9
    assert m.total_output_tokens == m.total_streamed_tokens == 96


def test_no_cap_sends_everything_at_once(fake_server: FakeServer) -> None:
    fake_server.state.options.gather = 10  # none streams before all 10 are in flight
    run = run_timed(_client(fake_server), _items(10), RunConfig())
    assert fake_server.state.max_in_flight == 10 and all(r.success for r in run.records)
    fake, starts = _fake_clock_run(fake_server, 10, math.inf)
    assert fake.sleeps == [] and starts == [0.0] * 10  # rate inf: no wait before any send


def test_finite_rate_spreads_sends(fake_server: FakeServer) -> None:
    fake, starts = _fake_clock_run(fake_server, 6, 20.0)
    offs = arrival_offsets(6, 20.0, 1.0, np.random.default_rng(3))
    assert starts == pytest.approx(offs, abs=1e-9)  # each request sent at its arrival offset
    assert fake.sleeps == pytest.approx(np.diff(offs).tolist(), abs=1e-9)  # the gaps, in turn


def test_workers_share_the_load(fake_server: FakeServer) -> None:
    fake_server.state.options.delay_s = 0.02
    seen: list[int] = []
    run = run_timed(_client(fake_server), _items(12), RunConfig(max_concurrency=4, num_workers=2),
                    on_progress=seen.append)
    assert [r.index for r in run.records] == list(range(12))
    assert all(r.success for r in run.records)
    assert {r.worker for r in run.records} == {0, 1}
    assert fake_server.state.max_in_flight <= 4
    assert len(run.processes) == 2 and all(p.num_requests == 6 for p in run.processes)
    # one time axis from the common start: every record between it and the run's end (the
    # processes' wall clocks agree to far less than the 1 ms allowed)
    assert min(r.start for r in run.records) >= -1e-3
    assert run.duration >= max(r.start + r.latency for r in run.records) - 1e-6
    assert seen[-1] == 12


def test_warmup_short_request_and_failure(fake_server: FakeServer) -> None:
    rec = run_async(warmup(_client(fake_server), WorkItem([1, 2], 2, 100)))
    assert rec.success and rec.max_tokens == 32
    assert fake_server.state.bodies[-1]["max_tokens"] == 32
    fake_server.state.options.fail_status = 500
    with pytest.raises(ValueError, match="warm-up request .* failed: HTTP 500"):
        run_async(warmup(_client(fake_server), WorkItem([1, 2], 2, 100)))


def test_client_bound_flagged() -> None:
    busy = RunResult([], 1.0, [ProcessStats(0, 10, cpu_seconds=0.95, wall_seconds=1.0),
                               ProcessStats(1, 10, cpu_seconds=0.2, wall_seconds=1.0)])
    idle = RunResult([], 1.0, [ProcessStats(0, 10, cpu_seconds=0.5, wall_seconds=1.0)])
    assert busy.client_bound and not idle.client_bound
    m = compute_metrics([], 1.0)
    kw = dict(max_concurrency=4, request_rate=math.inf, config={}, server={}, engine=None,
              device=None, git={"commit": "abc", "dirty": False}, warnings=[])
    res = build_result(m, busy, **kw)  # type: ignore[arg-type]
    assert res["client_bound"] is True
    assert any(w.startswith("client-bound: the client, not the server, may be the limit")
               and "--workers" in w for w in res["warnings"])
    assert res["client"][0]["cpu_fraction"] == pytest.approx(0.95)
    assert build_result(m, idle, **kw)["client_bound"] is False  # type: ignore[arg-type]
