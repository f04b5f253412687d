"""Samplers: NVML series from a fake NVML module (no GPU here), process CPU, process roles of a
server tree, the periodic thread (its schedule on a fake clock)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from moeserve.bench.server import free_port
from moeserve.diagnose.telemetry import (
    GpuSampler,
    Periodic,
    ProcessCpuSampler,
    server_processes,
)
from tests.wait import wait_until


class FakeNvml:
    """pynvml's functions over two made-up GPUs; GPU 1's power read fails once."""

    NVML_CLOCK_SM = 1

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.power_calls = 0
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000  # mW

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=144 << 30, used=(100 + h) << 20)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self.power_calls += 1
        if h == 1 and self.power_calls == 2:
            raise RuntimeError("transient")
        return 250_500 + h * 1000

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        assert kind == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + h)

    def nvmlShutdown(self) -> None:
        self.shut = True


def test_gpu_sampler_series_and_units() -> None:
    nvml = FakeNvml()
    s = GpuSampler(0.1, nvml)
    assert s.open()
    s.sample(10.0)
    s.sample(10.1)
    s.close()
    d = s.to_dict(origin=10.0)
    assert nvml.shut and d["available"] and d["reason"] is None
    assert d["t"] == [0.0, 0.1]
    g0, g1 = d["devices"]
    assert g0["name"] == "NVIDIA H200" and g0["power_limit_w"] == 700.0
    assert g0["power_w"] == [250.5, 250.5] and g1["power_w"] == [None, 251.5]
    assert g0["sm_clock_mhz"] == [1980, 1980] and g1["util_pct"] == [41, 41]
    assert g1["memory_used_mib"] == [101.0, 101.0] and g0["memory_total_mib"] == 144 * 1024


def test_gpu_sampler_says_why_not() -> None:
    s = GpuSampler(0.1, FakeNvml(fail_init=True))
    assert not s.open()
    assert "Driver Not Loaded" in s.reason and s.to_dict(0.0)["available"] is False


def test_process_cpu_sampler_measures_a_busy_process() -> None:
    s = ProcessCpuSampler([(os.getpid(), "engine"), (2 ** 22 + 12345, "api")])
    cpu0 = time.process_time()
    s.sample(10.0)  # the `now`s are the sampler's clock: 2 s apart, whatever the wall clock did
    while time.process_time() - cpu0 < 0.05:  # 50 ms of CPU, however long a loaded machine takes
        pass
    cpu1 = time.process_time()
    s.sample(12.0)
    d = s.to_dict(origin=10.0)
    me, gone = d["processes"]
    assert d["t"] == [2.0]
    # the CPU seconds the process itself counted, over the 2 s between the samples, within the
    # kernel's clock ticks (psutil reads user + system in 10 ms ticks)
    assert me["cpu_fraction"][0] * 2.0 == pytest.approx(cpu1 - cpu0, abs=0.025)
    assert me["cpu_fraction"][0] > 0  # it did see the busy loop
    assert gone["cpu_fraction"] == [None]


_TREE = """
import socket, subprocess, sys, time
listen_in_parent = sys.argv[1] == "parent"
port = int(sys.argv[2])
child_code = "import time; time.sleep(60)"
if not listen_in_parent:
    child_code = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', %d)); "
                  "s.listen(); time.sleep(60)" % port)
child = subprocess.Popen([sys.executable, "-c", child_code])
if listen_in_parent:
    s = socket.socket(); s.bind(("127.0.0.1", port)); s.listen()
print("ready", flush=True)
try:
    time.sleep(60)
finally:
    child.kill()
"""


@pytest.mark.parametrize("who_listens, roles", [("parent", ["api", "engine"]),
                                                 ("child", ["launcher", "api"])])
def test_server_process_roles(who_listens: str, roles: list[str]) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _TREE, who_listens, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while True:  # the child binds on its own schedule
            found = server_processes(proc.pid, port)
            if [r for _, r in found] == roles or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [r for _, r in found] == roles
        assert found[0][0] == proc.pid
    finally:
        for child in psutil.Process(proc.pid).children():
            child.kill()
        proc.kill()
        proc.wait()
    with pytest.raises(ValueError, match="not readable"):
        server_processes(proc.pid, port)


class FakeTicks:
    """A clock and a wait for Periodic: `wait(s)` moves the clock s ahead at once and the
    `stop_after`-th wait reports a stop (then `stopped` is set)."""

    def __init__(self, now: float, stop_after: int) -> None:
        self.now = now
        self.stop_after = stop_after
        self.waits: list[float] = []
        self.stopped = threading.Event()

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        if len(self.waits) < self.stop_after:
            return False
        self.stopped.set()
        return True


def test_periodic_keeps_its_period_and_never_bursts() -> None:
    ticks = FakeTicks(100.0, stop_after=5)
    calls: list[float] = []

    def sample(now: float) -> None:
        calls.append(now)
        if len(calls) == 2:
            ticks.now += 0.005  # a call a quarter of the period long
        if len(calls) == 3:
            ticks.now += 0.05  # a call 2.5 periods long

    p = Periodic(0.02, sample, "test", clock=ticks.clock, wait=ticks.wait)
    p.start()
    assert ticks.stopped.wait(30)
    p.stop()
    # every 20 ms from the start (a short call shortens the wait after it); after the long call
    # the next sample comes at once and the period restarts there: no burst to catch up
    assert calls == pytest.approx([100.0, 100.02, 100.04, 100.09, 100.11])
    assert ticks.waits == pytest.approx([0.02, 0.015, 0.0, 0.02, 0.02])
    assert p.error is None


def test_periodic_on_the_real_clock_samples_until_stopped() -> None:
    calls: list[float] = []
    p = Periodic(0.001, calls.append, "test")
    p.start()
    wait_until(lambda: len(calls) >= 3, "three samples")
    p.stop()
    assert not p._thread.is_alive() and calls == sorted(calls)


def test_periodic_keeps_the_first_error() -> None:
    raised = threading.Event()

    def boom(now: float) -> None:
        raised.set()
        raise OSError("gone")

    p = Periodic(0.01, boom, "boom")
    p.start()
    assert raised.wait(30)
    p.stop()
    assert p.error == "OSError: gone"
    with pytest.raises(ValueError, match="interval must be > 0"):
        Periodic(0, boom, "zero")
