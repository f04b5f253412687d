"""What the bench knows about the server: start one itself, ask it questions, and provenance.

- `ServerProcess`: without --url the bench starts `python -m moeserve.cli serve --preset P
  --port <free>` (plus --server-args), waits for GET /ready == 200, and stops it afterwards
  (SIGTERM, then SIGKILL). Its output goes to a log file whose tail is shown if it dies.
- `get_json`: GET a JSON route (/v1/engine, /v1/models) with the standard library, before the
  run (no event loop needed).
- `find_key`: a field anywhere in the /v1/engine response (device, ...), so the bench does not
  depend on that document's exact nesting; `vocab_size_of` finds the vocabulary size there or
  in the served model's own config.
- `git_commit`: the moeserve commit the results came from.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from moeserve import envs

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages)


def get_json(base_url: str, path: str, api_key: str | None = None,
             timeout_s: float = 10.0) -> Any | None:
    """GET base_url + path as JSON; None if the server answers with an error status (e.g. a
    foreign server without that route). Raises ValueError when the server cannot be reached."""
    req = urllib.request.Request(base_url.rstrip("/") + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach the server at {base_url}: {e}") from e
    except json.JSONDecodeError:
        return None


def first_model(base_url: str, api_key: str | None) -> str:
    """The id of the first model in GET /v1/models."""
    models = get_json(base_url, "/v1/models", api_key)
    try:
        return str(models["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        raise ValueError(f"GET {base_url}/v1/models listed no model: pass --model") from None


def server_cpu_seconds(base_url: str, api_key: str | None = None) -> float | None:
    """The API side's CPU seconds from /metrics (moeserve's `moeserve_api_cpu_seconds_total`,
    summed over its API processes, else `process_cpu_seconds_total`), or None when the server
    exports neither: sampled around a run to see whether the API side was busy."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        req = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("moeserve_api_cpu_seconds_total", "process_cpu_seconds_total"):
            values[name] = float(value)
    return values.get("moeserve_api_cpu_seconds_total", values.get("process_cpu_seconds_total"))


def find_key(doc: Any, key: str) -> Any | None:
    """The value of the first `key` in a nested JSON document (breadth-first), or None."""
    level = [doc]
    while level:
        nxt: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                if key in node and node[key] is not None:
                    return node[key]
                nxt.extend(node.values())
            elif isinstance(node, list):
                nxt.extend(node)
        level = nxt
    return None


def vocab_size_of(engine: Any | None) -> tuple[int | None, str]:
    """(vocabulary size, where it came from) for random token-id prompts.

    A `vocab_size` anywhere in the /v1/engine response first; else the served model's own
    config: a built-in preset by name, or config.json in the model folder when the server's
    folder is also readable here. (None, "") when neither gives one.
    """
    vocab = find_key(engine, "vocab_size")
    if isinstance(vocab, int):
        return vocab, "GET /v1/engine"
    cfg = find_key(engine, "engine_config")
    model = cfg.get("model") if isinstance(cfg, dict) else None
    if not isinstance(model, str):
        return None, ""
    from moeserve.presets import is_preset, load_preset

    if is_preset(model):
        return find_key(load_preset(model), "vocab_size"), f"preset {model}"
    config = Path(model) / "config.json"
    if config.is_file():
        return find_key(json.loads(config.read_text()), "vocab_size"), str(config)
    return None, ""


def git_commit() -> dict[str, Any]:
    """{"commit", "dirty"}: $MOESERVE_GIT_COMMIT when set (it overrides a checkout, which on a
    copied tree may be stale), else the moeserve checkout's, else a GIT_COMMIT file next to the
    package; commit None when none of these exist."""
    if envs.git_commit():
        return {"commit": envs.git_commit(), "dirty": None}
    try:
        top = subprocess.run(["git", "-C", str(_PACKAGE_ROOT), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == _PACKAGE_ROOT:
            head = subprocess.run(["git", "-C", str(_PACKAGE_ROOT), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=10)
            status = subprocess.run(["git", "-C", str(_PACKAGE_ROOT), "status", "--porcelain",
                                     "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            if head.returncode == 0:
                return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    for f in (_PACKAGE_ROOT / "GIT_COMMIT", _PACKAGE_ROOT / "moeserve" / "GIT_COMMIT"):
        if f.is_file():
            return {"commit": f.read_text().strip(), "dirty": None}
    return {"commit": None, "dirty": None}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# what `moeserve serve` logs when its engine process dies (server/process/launch.py)
ENGINE_DIED = "the engine process died"


class ServerProcess:
    """A `moeserve serve` subprocess the bench owns; use as a context manager."""

    def __init__(self, preset: str, server_args: str = "", api_key: str | None = None,
                 host: str = "127.0.0.1", ready_timeout_s: float = 600.0,
                 module: str = "moeserve.cli") -> None:
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        extra = shlex.split(server_args)
        self.cmd = [sys.executable, "-m", module, "serve", "--host", host,
                    "--port", str(self.port)]
        if "--model" not in extra and "--preset" not in extra:
            self.cmd += ["--preset", preset]
        if api_key and "--api-key" not in extra:
            self.cmd += ["--api-key", api_key]
        self.cmd += extra
        self.api_key = api_key
        self.ready_timeout_s = ready_timeout_s
        self.log = tempfile.NamedTemporaryFile(prefix="moeserve-bench-server-", suffix=".log",
                                               delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the server. One whose engine died during the run (the server then exits by
        itself, after ending its requests) leaves its log, and the engine's traceback (or the
        log's end) goes to stderr: the bench's own output only shows the requests' errors."""
        died = self.proc is not None and self.proc.poll() is not None
        if self.proc is not None:
            self.log.flush()
            died = died or ENGINE_DIED in Path(self.log.name).read_text(errors="replace")
        if died:
            assert self.proc is not None
            state = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                     else "lost its engine")
            print(f"the server {state} during the run; its log ({self.log.name}):\n"
                  f"{self.failure_excerpt()}", file=sys.stderr, flush=True)
        self.stop(keep_log=died)

    def log_tail(self, num_lines: int = 30) -> str:
        lines = Path(self.log.name).read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def failure_excerpt(self, num_lines: int = 60) -> str:
        """The log's last traceback, through its exception line; without one, its end."""
        lines = Path(self.log.name).read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
        if not starts:
            return "\n".join(lines[-num_lines:])
        end = next((i for i in range(starts[-1] + 1, len(lines))
                    if lines[i] and not lines[i][0].isspace()), len(lines) - 1)
        return "\n".join(lines[starts[-1]:end + 1])

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server ({shlex.join(self.cmd)}) exited with code "
                                   f"{self.proc.returncode} before it was ready; its log "
                                   f"({self.log.name}) ends:\n{self.log_tail()}")
            try:
                req = urllib.request.Request(self.url + "/ready")
                with urllib.request.urlopen(req, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server ({shlex.join(self.cmd)}) was not ready after "
                           f"{self.ready_timeout_s:.0f} s (--server-timeout); its log ends:\n"
                           f"{self.log_tail()}")

    def stop(self, grace_s: float = 15.0, keep_log: bool = True) -> None:
        """SIGTERM, wait `grace_s`, then SIGKILL; the log is kept unless told otherwise."""
        stop_process(self.proc, grace_s)
        self.log.close()
        if not keep_log:
            Path(self.log.name).unlink(missing_ok=True)


def stop_process(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM a running server process, wait `grace_s` for it, then SIGKILL it."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
