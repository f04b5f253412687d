"""Several API server processes in front of one engine: `moeserve serve --api-servers N`.

    launcher (this process: no HTTP)
      |-- engine core process          binds one inbox and N outboxes (ipc, in a private folder)
      |-- API process 0 .. N-1         each: AsyncEngineClient.connect(client i) + uvicorn on the
                                       same port with SO_REUSEPORT (the kernel spreads clients)

One API process carries roughly 20k streamed tokens per second (benchmarks/results); N of them
carry N times that, while the engine still runs one step loop. Prometheus counters and histograms
are summed over the API processes (prometheus_client's multiprocess mode, in a folder of the
launcher's); `moeserve_api_cpu_seconds_total` sums their CPU. SIGINT/SIGTERM: the API processes
shut down first (in-flight requests end with an error), then the engine; if any of them dies, the
launcher stops the rest and exits with EXIT_ENGINE_DIED (3), as one API process does when its
engine dies. No process is left behind: the engine dies with the launcher (parent-death signal)
and each API process watches the launcher.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

from moeserve import envs
from moeserve.engine.process import protocol as p
from moeserve.server.process.launch import EXIT_ENGINE_DIED

logger = logging.getLogger("moeserve.server")
API_PIDS_FILE = p.API_PIDS_FILE  # the API processes' pids: the CPU metric, the engine's cleanup


def run_launcher(args: argparse.Namespace) -> int:
    from moeserve.engine.args import engine_kwargs_from_args
    from moeserve.engine.process.async_client import spawn_engine
    from moeserve.server.process.launch import bind_socket

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # fail now on a port in use, before starting anything
        bind_socket(args.host, args.port).close()
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        return 1
    ipc_dir = tempfile.mkdtemp(prefix="moeserve-")
    metrics_dir = os.path.join(ipc_dir, "prometheus")
    os.makedirs(metrics_dir)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API processes
    os.environ[envs.API_PIDS_FILE] = os.path.join(ipc_dir, API_PIDS_FILE)
    stop = _install_stop_handlers()
    engine = spawn_engine(engine_kwargs_from_args(args), ipc_dir, args.api_servers)
    ctx = multiprocessing.get_context("spawn")
    apis = [ctx.Process(target=_api_process, name=f"moeserve-api-{i}", daemon=False,
                        args=(args, ipc_dir, i, engine.pid)) for i in range(args.api_servers)]
    for proc in apis:
        proc.start()
    with open(os.environ[envs.API_PIDS_FILE], "w") as f:
        f.write(" ".join(str(proc.pid) for proc in apis))
    try:
        dead = _wait(stop, engine, apis)
    finally:
        _stop_all(engine, apis)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if dead is None:
        return 0
    # the engine ends by itself with 0 only after a failed start-up; an API process exits
    # with 1 when it could not start
    could_not_start = dead.exitcode == (0 if dead is engine else 1)
    return 1 if could_not_start else EXIT_ENGINE_DIED


def _install_stop_handlers() -> list[int]:
    """SIGINT/SIGTERM only record that a stop was asked for; the main loop acts on it."""
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    return stop


def _wait(stop: list[int], engine: multiprocessing.Process,
          apis: list[multiprocessing.Process]) -> multiprocessing.Process | None:
    """Until a stop signal (None) or the death of any process (that process)."""
    while not stop:
        dead = [p for p in [engine, *apis] if not p.is_alive()]
        if dead:
            logger.error("%s exited (code %s): stopping the server", dead[0].name,
                         dead[0].exitcode)
            return dead[0]
        time.sleep(0.2)
    return None


def _stop_all(engine: multiprocessing.Process, apis: list[multiprocessing.Process]) -> None:
    for proc in apis:  # the API processes end their in-flight requests, then exit
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    for proc in apis:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    engine.terminate()
    engine.join(10)
    if engine.is_alive():
        engine.kill()
        engine.join(5)


def _api_process(args: argparse.Namespace, ipc_dir: str, index: int, engine_pid: int) -> None:
    """Entry point of API process `index`: serve until SIGTERM or the launcher's death."""
    import sys
    import threading

    from moeserve.server.process.launch import EngineJoin, run_serve

    launcher = os.getppid()

    def watch_launcher() -> None:  # orphaned (launcher killed): stop like on SIGTERM
        while os.getppid() == launcher:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_launcher, daemon=True).start()
    sys.exit(run_serve(args, EngineJoin(ipc_dir, index, engine_pid)))
