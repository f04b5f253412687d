"""Telemetry samplers: GPUs through NVML and the server's processes through psutil, each on a
background thread at a fixed period, on one clock (time.perf_counter).

    Periodic(interval_s, fn)      calls fn(now) every interval_s until stop(); a slow call delays
                                  the next one, it never queues several (tests pass their own
                                  `clock` and `wait`)
    GpuSampler                    NVML (pynvml, from the nvidia-ml-py package): per device power
                                  draw and enforced limit (W), SM clock (MHz), GPU utilisation (%),
                                  memory used (MiB). `open()` says why not when there is no NVML
                                  or no GPU; a failed read is a None in its series
    ProcessCpuSampler             CPU use (cores: user + system seconds per second) of given pids
    server_processes(pid, port)   the processes of a `moeserve serve` tree by role: "api" (listens
                                  on the port), "launcher" (the root when it does not listen, i.e.
                                  --api-servers N), "engine" (the other direct child);
                                  multiprocessing's resource tracker is left out

Each sampler's `to_dict(origin)` gives column-oriented series with `t` in seconds from `origin`
(figures.py documents the format).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

MiB = 1 << 20


class Periodic:
    """A daemon thread calling `fn(now)` every `interval_s` seconds of `clock`.

    Args:
        clock: the time source; `now` is its reading (time.perf_counter).
        wait: blocks for up to the seconds it is given and returns True once stop() was called
            (None: the stop event's own wait). Tests pass a fake clock and wait.
    """

    def __init__(self, interval_s: float, fn: Callable[[float], None], name: str,
                 clock: Callable[[], float] = time.perf_counter,
                 wait: Callable[[float], bool] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"{name}: sampling interval must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.name = name
        self._fn = fn
        self._clock = clock
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s + 5)

    def _loop(self) -> None:
        due = self._clock()
        while not self._stop.is_set():
            try:
                self._fn(self._clock())
            except Exception as e:  # keep the first error; the run goes on without samples
                self.error = f"{type(e).__name__}: {e}"
                return
            due += self.interval_s
            now = self._clock()
            if due < now:  # late: the next sample one period from now, not a burst
                due = now
            if self._wait(due - now):
                return


def _rel(t: list[float], origin: float) -> list[float]:
    return [round(x - origin, 4) for x in t]


class GpuSampler:
    """Every GPU NVML sees. `open()` first; then `sample(now)` (from a Periodic) and `close()`."""

    def __init__(self, interval_s: float = 0.1, nvml: Any | None = None) -> None:
        self.interval_s = interval_s
        self._nvml = nvml
        self._handles: list[Any] = []
        self.devices: list[dict[str, Any]] = []
        self.t: list[float] = []
        self.reason: str | None = "not opened"

    def open(self) -> bool:
        """Initialise NVML and list the GPUs; False (and `reason`) when that is not possible."""
        try:
            nvml = self._nvml or importlib.import_module("pynvml")
        except ImportError:
            self.reason = "pynvml is not installed (pip install nvidia-ml-py)"
            return False
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            for i in range(count):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                name = nvml.nvmlDeviceGetName(h)
                self._handles.append(h)
                self.devices.append({
                    "index": i, "name": name.decode() if isinstance(name, bytes) else str(name),
                    "power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                    "memory_total_mib": nvml.nvmlDeviceGetMemoryInfo(h).total / MiB,
                    "power_w": [], "sm_clock_mhz": [], "util_pct": [], "memory_used_mib": []})
        except Exception as e:  # pynvml.NVMLError: no driver, no permission, ...
            self.reason = f"NVML: {type(e).__name__}: {e}"
            self.devices, self._handles = [], []
            return False
        self._nvml = nvml
        if not self.devices:
            self.reason = "NVML found no GPU"
            return False
        self.reason = None
        return True

    def _read(self, fn: Callable[[], float]) -> float | None:
        try:
            return fn()
        except Exception:  # one failed read must not end the series
            return None

    def sample(self, now: float) -> None:
        nvml = self._nvml
        self.t.append(now)
        for h, dev in zip(self._handles, self.devices):
            dev["power_w"].append(self._read(lambda h=h: nvml.nvmlDeviceGetPowerUsage(h) / 1e3))
            dev["sm_clock_mhz"].append(self._read(
                lambda h=h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
            dev["util_pct"].append(self._read(
                lambda h=h: nvml.nvmlDeviceGetUtilizationRates(h).gpu))
            dev["memory_used_mib"].append(self._read(
                lambda h=h: nvml.nvmlDeviceGetMemoryInfo(h).used / MiB))

    def close(self) -> None:
        if self._handles:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._handles = []

    def to_dict(self, origin: float) -> dict[str, Any]:
        return {"available": self.reason is None, "reason": self.reason,
                "interval_s": self.interval_s, "t": _rel(self.t, origin),
                "devices": self.devices}


class ProcessCpuSampler:
    """CPU use of fixed processes; the first sample is the baseline, each later one gives the
    cores used since the previous (None once a process is gone)."""

    def __init__(self, processes: list[tuple[int, str]], interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.t: list[float] = []
        self.processes: list[dict[str, Any]] = []
        self._procs: list[psutil.Process | None] = []
        self._last: list[float | None] = []
        self._last_t: float | None = None
        for pid, role in processes:
            self.processes.append({"pid": pid, "role": role, "cpu_fraction": []})
            try:
                self._procs.append(psutil.Process(pid))
            except psutil.Error:
                self._procs.append(None)
            self._last.append(None)

    def _cpu(self, i: int) -> float | None:
        proc = self._procs[i]
        if proc is None:
            return None
        try:
            times = proc.cpu_times()
            return times.user + times.system
        except psutil.Error:
            self._procs[i] = None
            return None

    def sample(self, now: float) -> None:
        cpu = [self._cpu(i) for i in range(len(self._procs))]
        if self._last_t is not None and now > self._last_t:
            self.t.append(now)
            for p, c, last in zip(self.processes, cpu, self._last):
                p["cpu_fraction"].append(None if c is None or last is None
                                         else round((c - last) / (now - self._last_t), 4))
        self._last, self._last_t = cpu, now

    def to_dict(self, origin: float) -> dict[str, Any]:
        return {"available": True, "reason": None, "interval_s": self.interval_s,
                "t": _rel(self.t, origin), "processes": self.processes}


def _listens_on(proc: psutil.Process, port: int) -> bool:
    try:
        conns = proc.net_connections(kind="inet")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in conns)


def server_processes(root_pid: int, port: int) -> list[tuple[int, str]]:
    """(pid, role) of a `moeserve serve` process tree (see the module docstring)."""
    try:
        root = psutil.Process(root_pid)
        children = root.children(recursive=False)
    except psutil.Error as e:
        raise ValueError(f"server process {root_pid} is not readable: {e}") from e
    out = [(root_pid, "api" if _listens_on(root, port) else "launcher")]
    for child in children:
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in cmd:
            continue
        out.append((child.pid, "api" if _listens_on(child, port) else "engine"))
    return out
