"""A rank that dies or stops mid-step ends `moeserve serve` the way an engine death does: every
stream gets an error event, the server exits with EXIT_ENGINE_DIED, the engine's log names the
rank, and no process is left. And every worker runs with the NVLink multicast guard set.

tiny-moe on CPU at --tp 2 (gloo), steps slowed by fault injection so the streams are mid-flight
when the worker is hit. Each wait is for an event (a process exit, a status), bounded only
against a hang; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import psutil
import pytest

from moeserve.parallel.env import NO_MULTICAST
from moeserve.server.process.launch import EXIT_ENGINE_DIED
from tests.faults.serve import ServeProcess
from tests.faults.test_supervision import EXIT_WAIT_S, _streams_through

TP2 = ("--tp", "2", "--torch-threads", "1", "--step-timeout-s", "3")


def _workers(server: ServeProcess) -> list[psutil.Process]:
    return [p for p in server.children() if "moeserve.parallel.worker" in " ".join(p.cmdline())]


def _environ(proc: psutil.Process) -> dict[str, str]:
    return proc.environ()


def test_every_worker_keeps_the_multicast_guard(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path, *TP2)
    try:
        workers = _workers(server)
        assert len(workers) == 1
        for worker in workers:
            env = _environ(worker)
            for name, value in NO_MULTICAST.items():
                assert env.get(name) == value, (name, env.get(name))
    finally:
        server.stop()


def test_an_operator_s_guard_value_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0 ")  # set by the operator: never overridden
    server = ServeProcess(tmp_path, *TP2)
    try:
        assert _environ(_workers(server)[0])["NCCL_NVLS_ENABLE"] == "0 "
    finally:
        server.stop()


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_failed_rank_ends_every_stream_and_the_server(tmp_path: Path, fault: str) -> None:
    server = ServeProcess(tmp_path, *TP2, faults="slow_step:20")
    everything = [psutil.Process(server.proc.pid), *server.children()]
    worker = _workers(server)[0]
    hit = (lambda: worker.send_signal(signal.SIGKILL)) if fault == "kill" else (
        lambda: worker.send_signal(signal.SIGSTOP))
    streams = asyncio.run(_streams_through(server.url, 8, hit))
    code = server.proc.wait(EXIT_WAIT_S)
    _, alive = psutil.wait_procs(everything, timeout=EXIT_WAIT_S)
    with_error = sum(1 for events in streams if isinstance(events, list) and len(events) >= 2
                     and "error" in events[-2] and events[-1] == "[DONE]")
    assert with_error == len(streams), streams
    assert code == EXIT_ENGINE_DIED
    assert not alive, f"processes left behind: {alive}"
    named = "rank 1 (pid" if fault == "kill" else "rank 1 stopped beating"
    assert named in server.output(), server.log_tail()
