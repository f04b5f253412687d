"""A real `moeserve serve` subprocess for the fault suite: tiny-moe on CPU, max_model_len 64 so
cases are quick, its own TMPDIR (so a leftover IPC folder is seen) and optional fault injection.
All load goes to 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from moeserve import envs

SERVE = [sys.executable, "-m", "moeserve.cli", "serve", "--preset", "tiny-moe", "--device", "cpu",
         "--max-model-len", "64", "--log-level", "warning"]
START_TIMEOUT_S = 180.0  # a generous bound on start-up, only so that a broken start fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`moeserve serve` with `extra` flags; `faults` is MOESERVE_FAULT_INJECT's value."""

    def __init__(self, tmp: Path, *extra: str, faults: str = "", wait: str = "/ready") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.log = tmp / f"serve-{self.port}.log"
        env = {**os.environ, "TMPDIR": str(tmp), envs.FAULT_INJECT: faults}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*SERVE, "--port", str(self.port), *extra], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, text=True)
        self.wait_for(wait)

    def wait_for(self, path: str) -> None:
        """Until GET `path` answers 200 (RuntimeError with the log if the server exits)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.output()}")
            try:
                if httpx.get(f"{self.url}{path}", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{path} never answered 200: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, num_lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-num_lines:])

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def engine(self) -> psutil.Process:
        return psutil.Process(self.engine_state()["server"]["engine_pid"])

    def engine_state(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine", timeout=10).json()

    def ipc_folders(self) -> list[Path]:
        return sorted(self.tmp.glob("moeserve-*"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
