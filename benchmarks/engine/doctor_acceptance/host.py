"""The host side of benchmarks/engine/doctor_acceptance/run.py (issue #5's GPU runs): the machine's
environment for a result (git commit, GPUs through NVML, torch / Triton versions), a `moeserve
serve` subprocess started, waited for and stopped (`Server`), and the wait for the GPUs' memory
to come back after a server stops.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# ---- environment ----------------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def gpu_info() -> dict[str, Any] | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_total_bytes": int(nv.nvmlDeviceGetMemoryInfo(h).total)})
        driver = nv.nvmlSystemGetDriverVersion()
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver, "gpus": gpus}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def gpu_memory_used() -> int | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        return sum(int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used)
                   for i in range(nv.nvmlDeviceGetCount()))
    except Exception:
        return None


def environment() -> dict[str, Any]:
    from moeserve.bench.server import git_commit

    gpu = gpu_info()
    names = [g["name"] for g in (gpu or {}).get("gpus", [])]
    return {"git": git_commit(), "device": names[0] if names else platform.processor() or "cpu",
            "gpu": gpu, "torch": _dist_version("torch"), "triton": _dist_version("triton"),
            "python": platform.python_version(), "platform": platform.platform(),
            "argv": sys.argv}


# ---- the server -----------------------------------------------------------------------------

class Server:
    """`moeserve serve` in a subprocess, its log under OUT/logs."""

    def __init__(self, key: str, preset: str, args: list[str], port: int, log_path: Path,
                 ready_timeout_s: float, host: str = "127.0.0.1") -> None:
        from moeserve.bench.server import free_port

        self.key, self.args = key, args
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.cmd = [sys.executable, "-m", "moeserve.cli", "serve", "--host", host,
                    "--port", str(self.port)]
        if "--model" not in args and "--preset" not in args:
            self.cmd += ["--preset", preset]
        self.cmd += args
        self.log_path, self.ready_timeout_s = log_path, ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None

    def start(self) -> None:
        t = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = t + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before "
                                   f"it was ready; {self.log_path} ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.monotonic() - t
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server was not ready after {self.ready_timeout_s:.0f} s; "
                           f"{self.log_path} ends:\n{self.log_tail()}")

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        from moeserve.bench.server import stop_process

        stop_process(self.proc, grace_s)


def wait_gpu_memory_back(baseline: int | None, timeout_s: float = 60.0) -> None:
    """After a server stops: wait until the GPUs' used memory is back near where it started,
    so the next server sizes its KV cache from the whole memory."""
    if baseline is None:
        return
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        used = gpu_memory_used()
        if used is None or used <= baseline + (2 << 30):
            return
        time.sleep(0.5)
    print(f"warning: GPU memory still {gpu_memory_used() or 0:,} bytes used after "
          f"{timeout_s:.0f} s (baseline {baseline:,})", flush=True)
