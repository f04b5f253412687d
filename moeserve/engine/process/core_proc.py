"""The engine core process: one busy loop, no HTTP in it.

    API processes --Hello/AddRequest/AbortRequests/Ping/Shutdown--> inbox -> [drain] -> step()
    API process i <--Ready / StepOutputs (its requests' outputs + stats) / Pong-- outbox i

Started by `AsyncEngineClient.start` (spawn) or by the multi-process launcher. It binds its
sockets, builds the EngineCore, then loops: drain every pending message without blocking while
there is work, step, and send each API process the step's outputs of its own requests in one
message. When idle it blocks on the inbox for up to 100 ms. A start-up failure is sent to every
API process as StartupFailed. It exits on Shutdown, on SIGTERM, or when its parent process is
gone, so no engine is ever left behind:

    the parent dies (even by kill -9)  -> the kernel sends SIGUSR1 (PR_SET_PDEATHSIG, Linux),
                                          and the loop also sees getppid() change: Orphaned,
                                          sockets closed, the IPC folder removed
    SIGTERM                            -> SystemExit: sockets closed, the IPC folder removed
                                          (with --api-servers it is the launcher's to remove,
                                          unless the launcher is gone)
    an API process stops reading       -> sends wait at most 100 ms at a time, checking that
                                          the parent lives (a blocking send would hang forever)

A step that raises (a fault no single request owns: a device error, out of memory) ends the
process with the traceback in its log and a non-zero exit code; the API side sees it die.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from collections import defaultdict

import zmq

from moeserve.engine.process import protocol as p
from moeserve.types import FinishReason

_IDLE_POLL_MS = 100
_SEND_POLL_MS = 100
_EXPERT_LOAD_PERIOD_S = 1.0
_PR_SET_PDEATHSIG = 1
_ORPHAN_CLEANUP_WAIT_S = 10.0  # orphaned: how long API processes may take to exit first
logger = logging.getLogger("moeserve.engine")


# NOTE: not SIGTERM, which is also how the launcher stops the engine: the kernel sends it
# when the thread that started this process exits, which for a process killed with -9 can be
# before its last thread is gone, while getppid() still names it; the signal itself tells
PARENT_DIED_SIGNAL = signal.SIGUSR1
_SIGNALS: list[int] = []  # SIGTERM / PARENT_DIED_SIGNAL received


class Orphaned(SystemExit):
    """The process that started the engine is gone."""


def run_engine_core(engine_kwargs: dict, ipc_dir: str, num_clients: int = 1,
                    parent: int | None = None) -> None:
    """Process entry point: serve the engine until Shutdown, SIGTERM or the parent's death.

    `parent`: the pid of the process that started this one (its death ends this one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(PARENT_DIED_SIGNAL, _on_signal)
    parent = os.getppid() if parent is None else parent
    orphaned = False
    try:
        _die_with_parent(parent)
        _serve(engine_kwargs, ipc_dir, num_clients, parent)
    except Orphaned:
        orphaned = True
        raise
    finally:
        # NOTE: a signal now would interrupt the clean-up and leave the folder behind
        for sig in (signal.SIGTERM, PARENT_DIED_SIGNAL):
            signal.signal(sig, signal.SIG_IGN)
        _remove_ipc_dir(ipc_dir, num_clients, orphaned or os.getppid() != parent)


def _remove_ipc_dir(ipc_dir: str, num_clients: int, orphaned: bool) -> None:
    """One API process: the folder is this engine's alone. Several: it is the launcher's (the
    API processes' metrics live there too), removed by the launcher; the engine removes it only
    when orphaned (the launcher is gone), once the API processes have exited."""
    if num_clients > 1:
        if not orphaned:
            return
        import psutil

        try:
            with open(os.path.join(ipc_dir, p.API_PIDS_FILE)) as f:
                pids = [int(pid) for pid in f.read().split()]
            psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)],
                              timeout=_ORPHAN_CLEANUP_WAIT_S)
        except (OSError, ValueError, psutil.Error):
            pass
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _on_signal(signum: int, frame: object) -> None:
    # NOTE: raised where the main thread is; inside a __del__ Python ignores it, so the loop
    # also checks _SIGNALS and stops at its next iteration
    _SIGNALS.append(signum)
    _raise_for_signal(signum)


def _raise_for_signal(signum: int) -> None:
    if signum == PARENT_DIED_SIGNAL:
        raise Orphaned(1)
    raise SystemExit(128 + signum)


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for PARENT_DIED_SIGNAL when the parent dies (Linux), then check that it
    has not died already (before the request)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, PARENT_DIED_SIGNAL, 0, 0,
                                                    0)
        except (OSError, AttributeError) as e:  # the getppid() checks still run
            logger.warning("PR_SET_PDEATHSIG is unavailable (%s)", e)
    if os.getppid() != parent:
        raise Orphaned(1)


def _serve(engine_kwargs: dict, ipc_dir: str, num_clients: int, parent: int) -> None:
    inbox_addr, outbox_addrs = p.ipc_addresses(ipc_dir, num_clients)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)  # the API side bounds what it sends (async_client.py)
    inbox.bind(inbox_addr)
    outboxes = []
    for addr in outbox_addrs:
        outboxes.append(ctx.socket(zmq.PUSH))
        outboxes[-1].bind(addr)
    try:
        core = _start(engine_kwargs, outboxes, parent)
        if core is not None:
            try:
                _EngineLoop(core, inbox, outboxes, parent).run()
            finally:
                core.close()  # the other ranks (tensor_parallel_size > 1)
    finally:
        inbox.close(linger=0)
        for box in outboxes:
            box.close(linger=1000)
        ctx.term()


def send(box: zmq.Socket, data: bytes, parent: int) -> None:
    """Send without ever blocking for good: an API process that stops reading fills its queue
    (the high-water mark), and a blocking send would then wait forever, even after the parent
    died. Waits up to _SEND_POLL_MS at a time, checking the parent in between."""
    while True:
        try:
            box.send(data, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            if os.getppid() != parent:
                raise Orphaned(1) from None
            box.poll(_SEND_POLL_MS, zmq.POLLOUT)


def _start(engine_kwargs: dict, outboxes: list[zmq.Socket], parent: int):
    from moeserve import envs
    from moeserve.engine.args import engine_config_from_kwargs
    from moeserve.engine.core import EngineCore

    for path in envs.fault_injection().get("hold_startup", ()):  # tests only
        while not os.path.exists(path):
            time.sleep(0.05)
    try:
        return EngineCore(engine_config_from_kwargs(**engine_kwargs))
    except Exception as e:  # report any start-up failure to the API processes, then exit
        message = str(e) if isinstance(e, ValueError) else traceback.format_exc()
        for box in outboxes:
            send(box, p.encode(p.StartupFailed(error=message)), parent)
        return None


class _EngineLoop:
    def __init__(self, core, inbox: zmq.Socket, outboxes: list[zmq.Socket], parent: int):
        self.core, self.inbox, self.outboxes, self.parent = core, inbox, outboxes, parent
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.owner: dict[str, int] = {}  # request id -> the API process that sent it
        self.refused: list[p.WireOutput] = []
        self.num_refused = 0
        self.breakdown: dict[str, float] = {}  # attention / MoE seconds of the latest eager sample
        self.loop_times = (0.0, 0.0, 0.0)  # the last busy iteration: whole, intake, outputs
        self.loop_totals = [0.0, 0.0, 0.0, 0.0]  # summed: whole, step, intake, outputs
        self.num_busy_iterations = 0
        self.stats_stale = False  # an add/abort changed the state since the last message
        self.running = True
        self.expert_load: dict | None = None
        self.expert_load_time = -_EXPERT_LOAD_PERIOD_S

    def run(self) -> None:
        while self.running:
            busy = self.core.has_unfinished_requests()
            start = time.perf_counter()
            self._drain(0 if busy else _IDLE_POLL_MS)
            if os.getppid() != self.parent:
                raise Orphaned(1)  # the process that started the engine is gone
            if _SIGNALS:
                _raise_for_signal(_SIGNALS[0])
            drained = time.perf_counter()
            outputs = self.core.step() if self.running else []
            stepped = time.perf_counter()
            idle = not self.core.has_unfinished_requests()
            if outputs or self.refused or (idle and self.stats_stale):
                # NOTE: the last message before going idle carries fresh stats (an abort of the
                # last request produces no output, but /metrics must see running == 0)
                self._send_outputs(self.refused + [p.WireOutput.from_output(o) for o in outputs],
                                   everyone=idle)
                self.refused = []
                self.stats_stale = not idle
            if busy:  # where a busy loop's time goes (the stats carry the previous iteration's)
                end = time.perf_counter()
                self.loop_times = (end - start, drained - start, end - stepped)
                for i, dt in enumerate((end - start, stepped - drained, drained - start,
                                        end - stepped)):
                    self.loop_totals[i] += dt
                self.num_busy_iterations += 1

    def _send_outputs(self, wire: list[p.WireOutput], everyone: bool) -> None:
        """One StepOutputs per API process that has outputs (every process when `everyone`)."""
        by_client: dict[int, list[p.WireOutput]] = defaultdict(list)
        for out in wire:
            client = self.owner.get(out.request_id, 0)
            if out.finished:
                self.owner.pop(out.request_id, None)
            by_client[client].append(out)
        stats = self._stats()
        for client, box in enumerate(self.outboxes):
            if client in by_client or everyone:
                send(box, p.encode(p.StepOutputs(outputs=by_client.get(client, []),
                                                 stats=stats)), self.parent)

    def _drain(self, timeout_ms: int) -> None:
        """Handle every message waiting in the inbox; wait up to timeout_ms for the first."""
        while self.running and self.poller.poll(timeout_ms):
            self._handle(p.decode_to_engine(self.inbox.recv()))
            timeout_ms = 0

    def _handle(self, msg: p.ToEngine) -> None:
        self.stats_stale |= isinstance(msg, (p.AddRequest, p.AbortRequests))
        if isinstance(msg, p.AddRequest):
            self.owner[msg.request_id] = msg.client
            try:
                self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params.to_params())
            except ValueError as e:  # refused: only this request fails
                self.num_refused += 1
                self.refused.append(p.WireOutput(msg.request_id, [], finished=True,
                                                 finish_reason="abort", error=str(e)))
        elif isinstance(msg, p.AbortRequests):
            self.core.abort(msg.request_ids, FinishReason(msg.reason))
            for rid in msg.request_ids:
                self.owner.pop(rid, None)
        elif isinstance(msg, p.Ping):
            stats = self._stats()
            stats.expert_load = self._expert_load()
            send(self.outboxes[msg.client], p.encode(p.Pong(seq=msg.seq, stats=stats)),
                 self.parent)
        elif isinstance(msg, p.Hello):
            send(self.outboxes[msg.client], p.encode(self._ready()), self.parent)
        elif isinstance(msg, p.Shutdown):
            self.running = False

    def _expert_load(self) -> dict | None:
        """The device counters: while the engine is busy, at most once a second and without a
        host sync (an asynchronous copy, read one request later: a sync would stall the overlap
        of CPU and GPU); fresh (synchronous) when it is idle."""
        now = time.monotonic()
        idle = not self.core.has_unfinished_requests()
        if idle or now - self.expert_load_time >= _EXPERT_LOAD_PERIOD_S:
            runner = self.core.runner
            load = runner.expert_load() if idle else runner.expert_load_async()
            self.expert_load = load if load is not None else self.expert_load
            self.expert_load_time = now
        return self.expert_load

    def _ready(self) -> p.Ready:
        core = self.core
        return p.Ready(capacity_report=core.report.to_dict(),
                       max_model_len=core.cfg.scheduler.max_model_len,
                       max_running_requests=core.max_running_requests,
                       vocab_size=core.model_config.vocab_size)

    def _stats(self) -> p.EngineStats:
        s, c = self.core.scheduler, self.core.counters
        profiler = self.core.runner.profiler
        sample = profiler.latest if profiler is not None else None
        profile = {} if sample is None else {
            "gpu_step_seconds": sample.forward_ms / 1e3, "profiled_tokens": sample.num_tokens}
        if sample is not None and sample.attention_ms is not None:
            self.breakdown = {"attention_seconds": sample.attention_ms / 1e3,
                              "moe_seconds": sample.moe_ms / 1e3,
                              "comm_seconds": (sample.comm_ms or 0.0) / 1e3,
                              "eager_step_seconds": sample.forward_ms / 1e3}
        profile |= self.breakdown  # the latest eager step's (graph replays have none)
        if profiler is not None:
            profile |= {"num_profiled_forwards": profiler.num_profiled_forwards,
                        "profiled_device_seconds_total": profiler.profiled_device_seconds_total,
                        "profiled_wall_seconds_total": profiler.profiled_wall_seconds_total}
        runner = self.core.runner
        return p.EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.stats.kv_usage,
            num_steps=s.stats.num_scheduled_steps, num_preemptions=s.stats.num_preemptions,
            num_prefix_hit_tokens=s.stats.num_prefix_hit_tokens,
            num_prompt_tokens=c.num_prompt_tokens, num_generated_tokens=c.num_generated_tokens,
            num_aborted=s.stats.num_aborted, num_failed=s.stats.num_failed,
            num_refused=self.num_refused, num_oom_steps=self.core.oom.num_recoveries,
            num_structured=len(self.core.structured.grammars),
            num_grammar_waits=self.core.structured.num_overlap_waits,
            step_seconds=c.last_step_seconds, schedule_seconds=c.schedule_seconds,
            loop_seconds=self.loop_times[0], intake_seconds=self.loop_times[1],
            send_seconds=self.loop_times[2], busy_loop_seconds_total=self.loop_totals[0],
            busy_step_seconds_total=self.loop_totals[1],
            busy_intake_seconds_total=self.loop_totals[2],
            busy_send_seconds_total=self.loop_totals[3],
            num_busy_iterations=self.num_busy_iterations,
            num_recorded_steps=c.num_recorded_steps, slow_steps=list(c.slow_steps),
            num_forward_steps=runner.num_forward_steps, num_graph_steps=runner.num_graph_steps,
            num_mixed_graph_steps=runner.num_mixed_graph_steps,
            cuda_graph_fallbacks=runner.num_eager_decode_fallbacks, **profile)
