"""The timed run: arrivals, the concurrency cap, client processes, warm-up, client CPU.

    warmup()        one short request (<= 32 output tokens), then 1 s of quiet
    run_timed()     N = 1: the requests in this process's event loop
                    N > 1: N spawned processes, each with its share of the requests (i::N), of
                    the concurrency and of the rate; they start together at a wall-clock time
                    the parent sets once all are ready, so their records share one time axis
    per process:    t = 0 at the run start; request i is released at its arrival offset
                    (rate inf: all at 0; else gamma gaps, shape = burstiness, mean 1 / rate:
                    burstiness 1 is a Poisson process), waits for a slot of the
                    asyncio.Semaphore(max_concurrency), then sends (its clock starts there)
    duration        from the run start to the last response of any process
    client CPU      user + system CPU seconds of each process over its run / the run's wall
                    time; above CLIENT_BOUND_CPU the client, not the server, may be the limit
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import psutil

from moeserve.bench.client import ClientConfig, make_session, send_request
from moeserve.bench.records import RequestRecord
from moeserve.bench.workloads import WorkItem

CLIENT_BOUND_CPU = 0.9  # a client process busier than this share of one core is the suspect
WARMUP_MAX_TOKENS = 32
WARMUP_PAUSE_S = 1.0

T = TypeVar("T")
ProgressFn = Callable[[int], None]  # called with the number of requests finished so far


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How one timed run sends its requests."""

    max_concurrency: int | None = None  # in-flight cap over all processes; None = no cap
    request_rate: float = math.inf  # requests per second; inf = all at time 0
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    seed: int = 0  # for the arrival gaps
    num_workers: int = 1  # client processes

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.num_workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.num_workers}")
        if self.max_concurrency is not None and self.num_workers > self.max_concurrency:
            raise ValueError(f"--workers {self.num_workers} > --max-concurrency "
                             f"{self.max_concurrency}: each process needs a share of at least 1")


@dataclass(slots=True)
class ProcessStats:
    """One client process's share of a run."""

    worker: int
    num_requests: int
    cpu_seconds: float  # user + system over its run
    wall_seconds: float  # its run, from the start to its last response

    @property
    def cpu_fraction(self) -> float:
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def client_bound(self) -> bool:
        return self.cpu_fraction > CLIENT_BOUND_CPU


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]  # in workload order
    duration: float  # seconds
    processes: list[ProcessStats]

    @property
    def client_bound(self) -> bool:
        return any(p.client_bound for p in self.processes)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on uvloop when it is installed (a faster client)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def raise_open_file_limit() -> None:
    """Each stream is a socket: lift the soft limit on open files to the hard one (as
    bench_serving does), so thousands of concurrent requests do not fail with EMFILE."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 65535
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator
                    ) -> list[float]:
    """Send times (seconds from the run start) of n requests; the first is at 0."""
    if math.isinf(rate) or n <= 1:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def split_evenly(total: int, parts: int, index: int) -> int:
    """Share `index` of `total` split over `parts` (the first ones get the remainder)."""
    return total // parts + (1 if index < total % parts else 0)


async def run_process(cfg: ClientConfig, items: list[WorkItem], indices: list[int],
                      max_concurrency: int | None, rate: float, burstiness: float, seed: int,
                      worker: int = 0, on_done: Callable[[], None] | None = None,
                      wait_start: Callable[[], Coroutine[Any, Any, float]] | None = None,
                      clock: Callable[[], float] = time.perf_counter,
                      sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                      ) -> tuple[list[RequestRecord], ProcessStats, float]:
    """One process's requests. Returns its records, its stats and its origin's wall time.

    `wait_start` (workers) waits for the common start and returns its wall time; records are
    shifted so that `start` counts from that common start. `clock` and `sleep` time the
    arrivals and the records (tests pass fakes).
    """
    raise_open_file_limit()
    records = [RequestRecord(index=i, prompt_len=it.prompt_len, max_tokens=it.output_len,
                             worker=worker) for i, it in zip(indices, items)]
    offsets = arrival_offsets(len(items), rate, burstiness, np.random.default_rng(seed))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_session(cfg.timeout_s) as session:
        start_wall = await wait_start() if wait_start is not None else None
        proc = psutil.Process()
        cpu0 = sum(proc.cpu_times()[:2])
        origin, origin_wall = clock(), time.time()

        async def one(item: WorkItem, rec: RequestRecord) -> None:
            if sem is None:
                await send_request(session, cfg, item, rec, origin, clock)
            else:
                async with sem:
                    await send_request(session, cfg, item, rec, origin, clock)
            if on_done is not None:
                on_done()

        tasks = []
        for item, rec, at in zip(items, records, offsets):
            delay = at - (clock() - origin)
            if delay > 0:
                await sleep(delay)
            tasks.append(asyncio.create_task(one(item, rec)))
        await asyncio.gather(*tasks)
        wall = clock() - origin
        cpu = sum(proc.cpu_times()[:2]) - cpu0
    if start_wall is not None:
        shift = origin_wall - start_wall  # >= 0: how late this process woke up
        for rec in records:
            rec.start += shift
    return records, ProcessStats(worker, len(items), cpu, wall), origin_wall + wall


async def warmup(cfg: ClientConfig, item: WorkItem) -> RequestRecord:
    """One request of at most 32 output tokens, then 1 s of quiet. Raises ValueError if it
    fails (the benchmark would only measure errors)."""
    short = WorkItem(item.prompt, item.prompt_len, min(item.output_len, WARMUP_MAX_TOKENS))
    rec = RequestRecord(index=-1, prompt_len=short.prompt_len, max_tokens=short.output_len)
    async with make_session(cfg.timeout_s) as session:
        await send_request(session, cfg, short, rec, time.perf_counter())
    if not rec.success:
        raise ValueError(f"the warm-up request to {cfg.endpoint} failed: {rec.error}")
    await asyncio.sleep(WARMUP_PAUSE_S)
    return rec


def run_timed(cfg: ClientConfig, items: list[WorkItem], run: RunConfig,
              on_progress: ProgressFn | None = None) -> RunResult:
    """The timed run of `items` (in this process, or over `run.num_workers` processes)."""
    if run.num_workers > 1:
        return _run_workers(cfg, items, run, on_progress)
    done = [0]

    def on_done() -> None:
        done[0] += 1
        if on_progress is not None:
            on_progress(done[0])

    records, stats, _ = run_async(run_process(
        cfg, items, list(range(len(items))), run.max_concurrency, run.request_rate,
        run.burstiness, run.seed, on_done=on_done))
    return RunResult(records, stats.wall_seconds, [stats])


def _worker_main(worker: int, cfg: ClientConfig, items: list[WorkItem], indices: list[int],
                 concurrency: int | None, rate: float, burstiness: float, seed: int,
                 ready: Any, start_at: Any, done: Any, results: Any) -> None:
    """Entry point of a spawned client process: run its share, put the result on `results`."""

    def on_done() -> None:
        with done.get_lock():
            done.value += 1

    async def wait_start() -> float:
        with ready.get_lock():
            ready.value += 1
        while start_at.value == 0.0:
            await asyncio.sleep(0.001)
        await asyncio.sleep(max(0.0, start_at.value - time.time()))
        return start_at.value

    try:
        out = run_async(run_process(cfg, items, indices, concurrency, rate, burstiness, seed,
                                    worker, on_done, wait_start))
        results.put((worker, out, None))
    except BaseException as e:  # report it to the parent rather than die silently
        results.put((worker, None, f"{type(e).__name__}: {e}"))


def _run_workers(cfg: ClientConfig, items: list[WorkItem], run: RunConfig,
                 on_progress: ProgressFn | None) -> RunResult:
    n = run.num_workers
    ctx = mp.get_context("spawn")
    ready, start_at, done = ctx.Value("i", 0), ctx.Value("d", 0.0), ctx.Value("i", 0)
    results = ctx.Queue()
    procs = []
    for w in range(n):
        conc = split_evenly(run.max_concurrency, n, w) if run.max_concurrency else None
        args = (w, cfg, items[w::n], list(range(len(items)))[w::n], conc,
                run.request_rate / n, run.burstiness, run.seed * 1000 + w,
                ready, start_at, done, results)
        procs.append(ctx.Process(target=_worker_main, args=args, daemon=True))
    for p in procs:
        p.start()
    try:
        _wait_ready(procs, ready, n)
        start_at.value = start = time.time() + 0.05
        outs = _collect(procs, results, done, n, on_progress)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    records = sorted((r for recs, _, _ in outs for r in recs), key=lambda r: r.index)
    return RunResult(records, max(end for _, _, end in outs) - start, [s for _, s, _ in outs])


def _wait_ready(procs: list[Any], ready: Any, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while ready.value < n:
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"a bench worker process exited with code {dead[0].exitcode} "
                               f"before the run started")
        if time.time() > deadline:
            raise RuntimeError(f"bench worker processes not ready after {timeout_s:.0f} s")
        time.sleep(0.01)


def _collect(procs: list[Any], results: Any, done: Any, n: int,
             on_progress: ProgressFn | None) -> list[Any]:
    outs: list[Any] = []
    while len(outs) < n:
        try:
            worker, out, err = results.get(timeout=0.1)
        except queue.Empty:
            if on_progress is not None:
                on_progress(done.value)
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a bench worker process died during the run") from None
            continue
        if err is not None:
            raise RuntimeError(f"bench worker {worker} failed: {err}")
        outs.append(out)
    if on_progress is not None:
        on_progress(done.value)
    return outs
