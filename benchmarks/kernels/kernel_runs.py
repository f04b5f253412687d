"""What the attention-kernel benchmarks (kernels_mla.py, kernels_dsa.py) share: their timer
and the JSON they rewrite after every case, so that a run cut short keeps what it measured.

    make_timer(smoke, warmup_ms, rep_ms[, flush])
                                           fn -> ms: triton.testing.do_bench on the GPU (its
                                           L2 flush writes; flush="read": read_flushed_bench,
                                           the same with a flush that reads), one eager call
                                           in a CPU smoke run (not a measurement)
    graph_timed(timer, fn, cuda)           the timer over fn captured in a CUDA graph (a
                                           decode step as serving runs it), eager on CPU
    run_device(smoke, name)                "cpu" through Triton's interpreter for a smoke run,
                                           else "cuda" (SystemExit without a GPU); SMOKE_HELP
    profiled_median_ms(fn, calls)          fn warmed up, then `calls` calls between
                                           cudaProfilerStart / Stop (what `ncu
                                           --profile-from-start off` sees): their median ms
    record(result, section, row, path, device)
    device_ceilings(device)                the roofline's ceilings of this GPU (an H100 SXM's
                                           or an H200's), else the H200's (ANCHORS.md's
                                           reference machine; a CPU smoke run)
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

Timer = Callable[[Callable[[], object]], float]
SMOKE_HELP = "tiny shapes on the CPU through Triton's interpreter (no timing)"


def run_device(smoke: bool, name: str) -> str:
    """The device a kernel benchmark runs on: "cpu" for a smoke run, with Triton's interpreter
    switched on (before the kernels import triton), else "cuda", which it needs."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU (or --smoke)")
    return "cuda"


def device_ceilings(device: str):
    """diagnose/bounds/roofline's Ceilings of the GPU a benchmark runs on, the H200's where it
    has none measured (and for a CPU smoke run): the shares of the bound a run reports are of
    its own machine's where that machine is measured. The JSON names which (`.name`)."""
    from moeserve.diagnose.bounds.roofline import CEILINGS, ceilings_for

    found = ceilings_for(torch.cuda.get_device_name()) if device == "cuda" else None
    return found or CEILINGS[0]


# how a timer empties the L2 before each timed call: "zero" writes a 256 MB buffer
# (triton.testing.do_bench's way), which leaves the L2 full of dirty lines that the timed call
# then writes back to DRAM as it reads (up to the L2's size: 50 MB on an H100, 60 on an H200);
# "read" reads a buffer of that size instead (clean lines: a served step's L2, holding the
# previous layer's weights, has next to no dirty lines to give back)
L2_FLUSHES = ("zero", "read")
FLUSH_BYTES = 256 * 1024 * 1024


def make_timer(smoke: bool, warmup_ms: int, rep_ms: int, flush: str = "zero") -> Timer:
    """fn -> its mean ms over calls each after an L2 flush (L2_FLUSHES); one eager call on a
    smoke run."""
    if flush not in L2_FLUSHES:
        raise ValueError(f"make_timer: flush {flush!r} is not one of {L2_FLUSHES}")
    if smoke:
        def one_call(fn: Callable[[], object]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return one_call
    if flush == "read":
        return functools.partial(read_flushed_bench, warmup_ms=warmup_ms, rep_ms=rep_ms)
    import triton.testing

    def bench(fn: Callable[[], object]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms))
    return bench


@functools.cache
def _read_flush_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    """(FLUSH_BYTES of fp32 ones, a scalar for their sum) on the GPU, made once."""
    return (torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda"),
            torch.empty((), dtype=torch.float32, device="cuda"))


def read_flushed_bench(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    """do_bench's measurement (a first call; a 5-call estimate that sizes the warm-up and the
    timed calls; the mean of CUDA-event times, each call after its flush) with the L2 emptied
    by reading FLUSH_BYTES into one sum rather than by zeroing them."""
    flush_buf, sink = _read_flush_buffers()

    def flush() -> None:
        torch.sum(flush_buf, dim=0, out=sink)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)  # flush included, as do_bench's
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, int(rep_ms / estimate)))]
    for begin, done in events:
        flush()
        begin.record()
        fn()
        done.record()
    torch.cuda.synchronize()
    return statistics.fmean(begin.elapsed_time(done) for begin, done in events)


def graph_timed(timer: Timer, fn: Callable[[], object], cuda: bool) -> float:
    """timer(fn) with fn (already run once, so compiled) captured in a CUDA graph and replayed:
    no host time between its launches, as in a served decode step. On CPU: timer(fn)."""
    if not cuda:
        return timer(fn)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return timer(graph.replay)
    finally:
        del graph


def profiled_median_ms(fn: Callable[[], object], calls: int) -> float:
    """fn compiled and warmed up (three calls), then `calls` calls each timed by CUDA events
    (host launch time included) between cudaProfilerStart and cudaProfilerStop: the median."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    torch.cuda.profiler.start()
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.profiler.stop()
    return statistics.median(times)


def record(result: dict, section: str, row: dict, path: str, device: str) -> None:
    """Append row to result[section], print it, rewrite the JSON at path, and on a GPU give the
    case's memory back before the next."""
    result[section].append(row)
    print(json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if device == "cuda":
        torch.cuda.empty_cache()
