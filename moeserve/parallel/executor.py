"""Rank 0's side of the ranks: start node 0's workers, and run each runner call on every rank.

`start_ranks(cfg)` (the engine core, at start-up) spawns node 0's other ranks as
`python -m moeserve.parallel.worker` processes (none under torchrun, which started them),
joins the world as rank 0 and returns a `RankedRunner` once its own runner is built. The
RankedRunner stands where the ModelRunner stood: the calls that change every rank's state
(`BROADCAST`) are sent on the control group, pickled plain data, before rank 0 runs them itself;
a gathered call's results are combined (the largest activation peak, the plan with the fewest
KV blocks, so every rank allocates the same blocks); everything else (counters, the step
profile, expert load) is rank 0's own.

Failure: the watchdog (parallel/watchdog.py) fires when a call, or the wait for a launched
step's result (where a hang in a collective captured in a CUDA graph shows), runs past
step_timeout_s; the
executor then kills node 0's workers, which ends rank 0's own wait in the collective, and a
call that raises afterwards, or any call that fails because a rank died, raises `RankFailed`
naming the rank. If rank 0 is still stuck after _EXIT_GRACE_S (a collective on the device
never returns), the process exits with EXIT_RANK_FAILED, so the API side ends every stream.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.parallel.env import free_port, guard_multicast, under_torchrun
from moeserve.parallel.group import RankGroups, join, leave
from moeserve.parallel.plan_codec import PLAN_CALLS, PlanEncoder
from moeserve.parallel.watchdog import Watchdog
from moeserve.parallel.worker import GATHERED, SHUTDOWN

logger = logging.getLogger("moeserve.parallel")

BROADCAST = frozenset({"profile_activation_peak", "plan_memory", "allocate_kv_caches",
                       "warmup", "init_decode_graphs", "init_mixed_graphs", "reset_counters",
                       "execute", "launch"})
EXIT_RANK_FAILED = 70
_EXIT_GRACE_S = 10.0
_DEATH_WAIT_S = 3.0  # how long a failed call waits to see which worker died


class RankFailed(RuntimeError):
    """A rank died, stopped or missed the step deadline; the message names it."""


def spawn_workers(cfg: EngineConfig, node_rank: int, master_port: int,
                  skip_local_rank_0: bool) -> list[subprocess.Popen]:
    """One worker process per local rank of `node_rank` (node 0's rank 0 is the engine)."""
    pc = cfg.parallel
    guard_multicast()  # inherited by every worker; values the operator set are kept
    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"
    fields = {f.name: getattr(pc, f.name) for f in dataclasses.fields(pc)}
    procs = []
    for local in range(1 if skip_local_rank_0 else 0, pc.ranks_per_node):
        rank = node_rank * pc.ranks_per_node + local
        cmd = [sys.executable, "-m", "moeserve.parallel.worker", "--rank", str(rank),
               "--local-rank", str(local), "--master-port", str(master_port),
               "--parallel", json.dumps(fields), "--device-type", device_type,
               "--parent", str(os.getpid())]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ)))
    return procs


def start_ranks(cfg: EngineConfig, build_runner) -> RankedRunner:
    """Start node 0's workers, join as rank 0, send every rank the resolved config, build
    rank 0's runner with `build_runner(tp)`."""
    pc = cfg.parallel
    port = pc.master_port or (int(os.environ["MASTER_PORT"]) if under_torchrun()
                              else free_port(pc.master_addr))
    procs = [] if under_torchrun() else spawn_workers(cfg, 0, port, skip_local_rank_0=True)
    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"
    try:
        groups = join(pc, 0, 0, port, device_type)
        ranked = RankedRunner(groups, procs, pc.step_timeout_s)
        ranked.send("init", (cfg,), {})
        ranked.runner = build_runner(groups.tp)
    except BaseException:
        _kill(procs)
        raise
    return ranked


class RankedRunner:
    """Rank 0's runner, its calls mirrored on every rank (see the module doc)."""

    def __init__(self, groups: RankGroups, procs: list[subprocess.Popen], timeout_s: float):
        self.groups, self.procs = groups, procs
        self.runner = None  # rank 0's ModelRunner, set once built
        self.world_size = groups.tp.layout.world_size
        self._failure: str | None = None
        self._exit_timer: threading.Timer | None = None
        self.watchdog = Watchdog.over_store(groups.store, self.world_size, timeout_s,
                                            self._on_deadline).start()
        self._closed = False
        self.encoder = PlanEncoder()

    def __getattr__(self, name: str):
        attr = getattr(self.runner, name)
        if name not in BROADCAST:
            return attr

        def call(*args, **kwargs):
            # the deadline covers the send too: it blocks once a stopped rank's socket
            # buffer is full (the fault test's stopped worker, under load)
            self.watchdog.begin(name)
            try:
                if name in PLAN_CALLS:  # the plan without the parameters the workers hold
                    self.send(name, self.encoder.encode(*args), kwargs)
                else:
                    self.send(name, args, kwargs)
                result = attr(*args, **kwargs)
                if name in GATHERED:
                    results: list = [None] * self.world_size
                    dist.gather_object(result, results, dst=0, group=self.groups.control)
                    result = _combine(name, results)
            except Exception as e:
                failure = self._failed(e)
                if failure is e:
                    raise
                raise failure from e
            finally:
                self.watchdog.end()
            if name == "launch":  # the device may still be in the step: watch its result too
                return _WatchedPending(result, self)
            return result
        return call

    def send(self, name: str, args: tuple, kwargs: dict) -> None:
        if self._failure is not None:
            raise RankFailed(self._failure)
        if self.world_size == 1:  # a world of one: no one to tell
            return
        try:
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.groups.control)
        except Exception as e:
            raise self._failed(e) from e

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for node 0's workers, leave the world."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.stop()
        if self._failure is None:
            try:
                dist.broadcast_object_list([(SHUTDOWN, (), {})], src=0,
                                           group=self.groups.control)
            except Exception as e:  # a rank already gone: the kill below ends the rest
                logger.warning("shutdown could not reach every rank: %s", e)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        _kill(self.procs)
        leave()

    def _failed(self, error: Exception) -> Exception:
        """The error to raise for a call that failed: RankFailed naming the rank that caused
        it, or rank 0's own error. Either way the other ranks are stopped (they would wait in
        the next collective for ever)."""
        if self._exit_timer is not None:  # rank 0 returned: the engine ends in order
            self._exit_timer.cancel()
        if self._failure is None:
            dead = self._dead_workers()
            self._failure = "; ".join(dead) or f"rank 0 failed: {error!r}"
            _kill(self.procs)
            if not dead:
                return error
        return RankFailed(self._failure)

    def _dead_workers(self) -> list[str]:
        """Node 0's workers that exited, each named. A peer's death reaches rank 0 as a closed
        connection while the kernel may still be tearing that process down, so a failure
        waits up to _DEATH_WAIT_S for one to be seen gone."""
        deadline = time.monotonic() + (_DEATH_WAIT_S if self.procs else 0.0)
        while True:
            dead = [f"rank {r + 1} (pid {p.pid}) exited with code {p.returncode}"
                    for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _on_deadline(self, message: str) -> None:
        logger.error("%s; ending the engine", message)
        self._failure = message
        _kill(self.procs)

        def exit_if_stuck() -> None:  # rank 0 still inside a collective that never returns
            logger.error("rank 0 did not return from the failed step: exiting")
            os._exit(EXIT_RANK_FAILED)
        self._exit_timer = threading.Timer(_EXIT_GRACE_S, exit_if_stuck)
        self._exit_timer.daemon = True
        self._exit_timer.start()


class _WatchedPending:
    """A launched step's PendingOutput whose result() (where rank 0 waits for the device, and
    so for the collectives inside the step's graphs) runs under the step deadline."""

    def __init__(self, pending, ranked: RankedRunner):
        self.pending, self.ranked = pending, ranked

    def result(self):
        self.ranked.watchdog.begin("waiting for a step's result")
        try:
            return self.pending.result()
        except Exception as e:
            failure = self.ranked._failed(e)
            if failure is e:
                raise
            raise failure from e
        finally:
            self.ranked.watchdog.end()

    def __getattr__(self, name: str):
        return getattr(self.pending, name)


def _combine(name: str, results: list):
    if name == "profile_activation_peak":
        return max(results)
    if name == "plan_memory":  # every rank allocates the blocks the tightest rank has
        return min(results, key=lambda plan: plan.num_blocks)
    raise AssertionError(name)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGKILL)
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
