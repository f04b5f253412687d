"""The API process's handle on the engine core process.

    generate(id, prompt, params) --AddRequest--> engine process --StepOutputs--> _read_outputs()
         ^                                                                          |
         '---- per-request asyncio.Queue <-- WireOutput (one per request per step) -'

The client starts the engine process, validates requests before they leave (so a bad request gets
a ValueError naming its problem and never reaches the engine), bounds the number of requests in
flight (QueueFullError beyond max_running_requests + max_waiting_requests: the server's 429),
detokenizes each step's tokens and applies stop strings, and aborts a request in the engine when
its consumer goes away. A consumer that falls behind gets the steps waiting in its queue merged
into one output (fewer detokenizations and SSE events when the API process is the busy one).
ZMQ does not report a dead peer, so a watchdog polls the engine process: when it dies, `alive`
turns False, every waiting generate() raises EngineDeadError at once, and `died` is set (the
server then exits non-zero for its supervisor to restart it).

    launch() -> starting: the engine process runs its start-up; `ready` False
    wait_ready() -> ready: Ready arrived (capacity report, limits); the tasks run
    start() = launch() + wait_ready()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import psutil
import zmq
import zmq.asyncio

from moeserve.config import load_model_config
from moeserve.engine.output_processor import OutputProcessor
from moeserve.engine.process import protocol as p
from moeserve.engine.process.core_proc import run_engine_core
from moeserve.engine.validate import validate_request
from moeserve.hf_config.generation import sampling_defaults
from moeserve.tokenizer import load_model_tokenizer
from moeserve.types import FinishReason, RequestOutput, SamplingParams

_WATCHDOG_SECONDS = 0.1


class EngineDeadError(RuntimeError):
    """The engine process died or is shutting down (HTTP 503)."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting (HTTP 429 with Retry-After)."""


class RequestFailedError(RuntimeError):
    """A fault of this request alone failed it in the engine or its detokenization (HTTP 500);
    the other requests go on."""


class AsyncEngineClient:
    def __init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._pings: dict[int, asyncio.Future] = {}
        self._ping_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._dead_reason: str | None = None
        self.stats = p.EngineStats()
        self.ready = False  # Ready arrived: the engine loop runs, the limits below are known
        self.died = asyncio.Event()  # the engine process died while serving (not a shutdown)
        self.sampling_defaults: dict[str, Any] = {}  # the model's, for omitted request fields

    @classmethod
    async def start(cls, engine_kwargs: dict, max_waiting_requests: int = 4096,
                    served_model_name: str | None = None,
                    startup_timeout: float = 600.0) -> AsyncEngineClient:
        """Spawn the engine process (for this one API process) and wait until it is ready;
        RuntimeError with the engine's own error if it fails to start."""
        client = cls.launch(engine_kwargs, max_waiting_requests, served_model_name)
        await client.wait_ready(startup_timeout)
        return client

    @classmethod
    def launch(cls, engine_kwargs: dict, max_waiting_requests: int = 4096,
               served_model_name: str | None = None) -> AsyncEngineClient:
        """Spawn the engine process and return at once, `ready` False (the server answers
        /health meanwhile); `wait_ready` next."""
        ipc_dir = tempfile.mkdtemp(prefix="moeserve-")
        try:
            proc = spawn_engine(engine_kwargs, ipc_dir, num_clients=1)
        except BaseException:
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        return cls._begin(engine_kwargs, ipc_dir, 0, proc, True, max_waiting_requests,
                          served_model_name)

    @classmethod
    def join(cls, engine_kwargs: dict, ipc_dir: str, client_index: int, engine_pid: int,
             max_waiting_requests: int = 4096,
             served_model_name: str | None = None) -> AsyncEngineClient:
        """Join an engine that another process started (one of several API processes);
        `wait_ready` next."""
        return cls._begin(engine_kwargs, ipc_dir, client_index, _PidHandle(engine_pid), False,
                          max_waiting_requests, served_model_name)

    @classmethod
    async def connect(cls, engine_kwargs: dict, ipc_dir: str, client_index: int,
                      engine_pid: int, max_waiting_requests: int = 4096,
                      served_model_name: str | None = None,
                      startup_timeout: float = 600.0) -> AsyncEngineClient:
        """`join` + `wait_ready`."""
        client = cls.join(engine_kwargs, ipc_dir, client_index, engine_pid,
                          max_waiting_requests, served_model_name)
        await client.wait_ready(startup_timeout)
        return client

    @classmethod
    def _begin(cls, engine_kwargs: dict, ipc_dir: str, client_index: int, proc: Any,
               owns_engine: bool, max_waiting_requests: int,
               served_model_name: str | None) -> AsyncEngineClient:
        self = cls()
        self._proc, self._owns_engine, self._client = proc, owns_engine, client_index
        self._ipc_dir = ipc_dir
        self.model = str(engine_kwargs.get("model", "tiny-moe"))
        self.model_name = served_model_name or self.model
        self.max_waiting_requests = max_waiting_requests
        try:
            # the engine's own config: the same overrides, merged before parsing
            self.model_config, _ = load_model_config(self.model,
                                                     engine_kwargs.get("hf_overrides"))
            mc = self.model_config
            self.tokenizer = load_model_tokenizer(self.model, engine_kwargs.get("tokenizer"), mc)
            self.sampling_defaults = sampling_defaults(  # generation_config.json's
                self.model, str(engine_kwargs.get("generation_config", "auto")))
            self._outputs = OutputProcessor(self.tokenizer)  # text deltas and stop strings
            self._init_sockets()
            self._send(p.Hello(client=client_index))
        except BaseException:
            if owns_engine:
                proc.kill()
                proc.join(5)
            self._close_now()
            raise
        return self

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for the engine's Ready; RuntimeError with the engine's own error if its
        start-up fails (the client is shut down then)."""
        try:
            await asyncio.wait_for(self._wait_ready(), timeout)
        except BaseException:
            await self.shutdown()
            raise
        self.ready = True
        self._tasks = [asyncio.create_task(self._read_outputs()),
                       asyncio.create_task(self._watchdog())]

    def _init_sockets(self) -> None:
        inbox, outboxes = p.ipc_addresses(self._ipc_dir, self._client + 1)
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        # NOTE: no high-water mark: a send must never fail while the engine is busy in a long
        # step (an "Again" would fail a request that admission accepted); what is queued is
        # bounded by admission (max running + waiting requests) and their aborts
        self._to_engine.setsockopt(zmq.SNDHWM, 0)
        self._to_engine.connect(inbox)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.connect(outboxes[self._client])

    async def _wait_ready(self) -> None:
        while True:
            if await self._from_engine.poll(100):
                msg = p.decode_from_engine(await self._from_engine.recv())
                if isinstance(msg, p.StartupFailed):
                    raise RuntimeError(f"the engine failed to start: {msg.error}")
                if isinstance(msg, p.Ready):
                    self.capacity_report = msg.capacity_report
                    self.max_model_len = msg.max_model_len
                    self.max_running_requests = msg.max_running_requests
                    return
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up "
                                   f"(exit code {self._proc.exitcode})")

    # ---- state ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The engine process runs (starting or serving) and this client is not shut down."""
        return self._dead_reason is None and self._proc.is_alive()

    @property
    def engine_pid(self) -> int:
        return self._proc.pid

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def check_ready(self, timeout: float = 1.0) -> bool:
        """True when the engine loop answers a ping within `timeout` seconds."""
        if not self.alive or not self.ready:
            return False
        seq = next(self._ping_ids)
        future = asyncio.get_running_loop().create_future()
        self._pings[seq] = future
        try:
            self._send(p.Ping(seq=seq, client=self._client))
            await asyncio.wait_for(future, timeout)
            return True
        except (TimeoutError, EngineDeadError):
            return False
        finally:
            self._pings.pop(seq, None)

    # ---- requests ------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs, one per engine step (see module doc)."""
        if not self.alive:
            raise EngineDeadError(self._dead_reason or "the engine process is not running")
        validate_request(prompt_token_ids, params, self.model_config.vocab_size,
                         self.max_model_len, self.model_config.eos_token_ids)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.num_in_flight >= self.max_running_requests + self.max_waiting_requests:
            raise QueueFullError(f"{self.num_in_flight} requests in flight: the waiting queue "
                                 f"({self.max_waiting_requests}) is full")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._outputs.add_request(request_id, prompt_token_ids, params)
        finished = False
        try:
            self._send(p.AddRequest(request_id, list(prompt_token_ids),
                                    p.WireSamplingParams.from_params(params), self._client))
            carry = None  # an item taken while coalescing that must come on its own
            while not finished:
                item, carry = (carry if carry is not None else await queue.get()), None
                if isinstance(item, BaseException):
                    raise item
                # NOTE: when the consumer fell behind (a busy API process), the steps waiting
                # in the queue become one output: one detokenisation, one SSE event, instead
                # of one per step. A caller keeping up sees one output per step, as before.
                while not item.finished and item.error is None and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException) or nxt.error is not None:
                        carry = nxt
                        break
                    item = _merge(item, nxt)
                out = self._to_output(item, prompt_token_ids)
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            self._outputs.abort(request_id)
            if not finished and self.alive:  # the consumer went away: free the request's KV
                self._send(p.AbortRequests([request_id]))

    def _to_output(self, wire: p.WireOutput, prompt: list[int]) -> RequestOutput:
        if wire.error is not None:
            if wire.finish_reason == FinishReason.ERROR.value:
                raise RequestFailedError(wire.error)
            raise ValueError(wire.error)  # refused by the engine's validation
        [out], stopped, failed = self._outputs.process([wire.to_output(prompt)])
        if stopped:  # a stop string: the engine does not know about those
            self._send(p.AbortRequests(stopped, FinishReason.STOP.value))
        if failed:
            self._send(p.AbortRequests(failed, FinishReason.ERROR.value))
        if out.finish_reason is FinishReason.ERROR:
            raise RequestFailedError(out.error or "the request failed")
        return out

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            if self.alive:
                self._send(p.AbortRequests([request_id]))
            queue.put_nowait(p.WireOutput(request_id, [], finished=True,
                                          finish_reason=FinishReason.ABORT.value))

    def _send(self, msg: p.ToEngine) -> None:
        if self._dead_reason is not None or not self._proc.is_alive():
            raise EngineDeadError(self._dead_reason or "the engine process is not running")
        # NOTE: PUSH to one connected peer never blocks under its high-water mark; send without
        # awaiting so that generate()'s cleanup can abort from a finally block.
        self._to_engine.send(p.encode(msg), flags=zmq.NOBLOCK)

    # ---- background tasks ----------------------------------------------------------------

    async def _read_outputs(self) -> None:
        """Route each message to its request; if this task fails, no output would ever arrive
        again: every request fails and `died` is set, as for a dead engine."""
        try:
            await self._route_messages()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail_all(f"the engine's outputs can no longer be read: {type(e).__name__}: {e}")
            self.died.set()
            raise

    async def _route_messages(self) -> None:
        while True:
            msg = p.decode_from_engine(await self._from_engine.recv())
            if isinstance(msg, p.StepOutputs):
                msg.stats.expert_load = self.stats.expert_load  # refreshed by pongs only
                self.stats = msg.stats
                for out in msg.outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            elif isinstance(msg, p.Pong):
                self.stats = msg.stats
                future = self._pings.get(msg.seq)
                if future is not None and not future.done():
                    future.set_result(None)

    async def _watchdog(self) -> None:
        while self._dead_reason is None:
            await asyncio.sleep(_WATCHDOG_SECONDS)
            if not self._proc.is_alive():
                self._fail_all(f"the engine process died (exit code {self._proc.exitcode})")
                self.died.set()

    def _fail_all(self, reason: str) -> None:
        """Mark the engine dead and end every in-flight request with EngineDeadError."""
        if self._dead_reason is None:
            self._dead_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._pings.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """End in-flight requests with EngineDeadError and close the sockets; the client that
        started the engine also stops the engine process."""
        connected = self._ctx is not None
        if self._owns_engine and connected and self._dead_reason is None:
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                self._send(p.Shutdown())
        self._fail_all("the server is shutting down")
        for task in self._tasks:
            task.cancel()
        if self._owns_engine:
            if not self.ready and self._proc.is_alive():
                # NOTE: an engine in start-up (weights, MoE tune) reads no message until its
                # loop starts; SIGTERM ends it now (it then removes its IPC folder itself)
                self._proc.terminate()
            # without sockets the engine never heard Shutdown: stop it now
            await stop_engine(self._proc, timeout if connected else 0.0)
        self._close_now()

    def _close_now(self) -> None:
        """Close the sockets; the client that started the engine removes its IPC folder."""
        if self._owns_engine:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._ctx is not None:
            self._to_engine.close(linger=0)
            self._from_engine.close(linger=0)
            self._ctx.term()
            self._ctx = None


def _merge(a: p.WireOutput, b: p.WireOutput) -> p.WireOutput:
    """Two consecutive outputs of one request as one: b's tokens after a's, b's end state."""
    logprobs = None if a.logprobs is None and b.logprobs is None else \
        (a.logprobs or []) + (b.logprobs or [])
    return p.WireOutput(a.request_id, a.new_token_ids + b.new_token_ids, b.finished,
                        b.finish_reason, b.stop_reason, logprobs,
                        max(a.num_cached_tokens, b.num_cached_tokens), b.error)


def spawn_engine(engine_kwargs: dict, ipc_dir: str, num_clients: int) -> Any:
    """Start the engine core process (spawn, daemon); it binds its sockets in `ipc_dir`."""
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, name="moeserve-engine", daemon=True,
        args=(dict(engine_kwargs), ipc_dir, num_clients, os.getpid()))
    proc.start()
    return proc


async def stop_engine(proc: Any, timeout: float = 10.0) -> None:
    """Wait for the engine process to exit (after Shutdown); kill it past `timeout`."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, proc.join, timeout)
    if proc.is_alive():
        proc.kill()
        await loop.run_in_executor(None, proc.join, 5.0)


class _PidHandle:
    """is_alive / exitcode / pid of an engine process this process did not start."""

    exitcode = None

    def __init__(self, pid: int):
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
