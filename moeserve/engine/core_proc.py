"""The engine core process: one busy loop, no HTTP in it.

    API process --AddRequest/AbortRequests/Ping/Shutdown--> [drain inbox] -> step() -> StepOutputs
                                                                   ^-- idle: block on the inbox

Started by `AsyncEngineClient.start` (spawn). It builds the EngineCore, sends Ready (or
StartupFailed with the error), then loops: drain every pending message without blocking while
there is work, step, and send all of the step's outputs in one message. When idle it blocks on
the inbox for up to 100 ms. It exits on Shutdown, or when its parent process is gone, so no engine
is ever left behind.
"""

from __future__ import annotations

import os
import signal
import traceback

import zmq

from moeserve.engine import protocol as p
from moeserve.types import FinishReason

_IDLE_POLL_MS = 100


def run_engine_core(engine_kwargs: dict, inbox_addr: str, outbox_addr: str) -> None:
    """Process entry point: serve the engine until Shutdown or the parent's death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outbox_addr)
    try:
        core = _start(engine_kwargs, outbox)
        if core is not None:
            _EngineLoop(core, inbox, outbox, parent).run()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _start(engine_kwargs: dict, outbox: zmq.Socket):
    from moeserve.engine.args import engine_config_from_kwargs
    from moeserve.engine.core import EngineCore

    try:
        core = EngineCore(engine_config_from_kwargs(**engine_kwargs))
    except Exception as e:  # report any start-up failure to the API process, then exit
        message = str(e) if isinstance(e, ValueError) else traceback.format_exc()
        outbox.send(p.encode(p.StartupFailed(error=message)))
        return None
    outbox.send(p.encode(p.Ready(capacity_report=core.report.to_dict(),
                                 max_model_len=core.cfg.scheduler.max_model_len,
                                 max_running_requests=core.max_running_requests,
                                 vocab_size=core.model_config.vocab_size)))
    return core


class _EngineLoop:
    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, parent: int):
        self.core, self.inbox, self.outbox, self.parent = core, inbox, outbox, parent
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.refused: list[p.WireOutput] = []
        self.num_refused = 0
        self.stats_stale = False  # an add/abort changed the state since the last message
        self.running = True

    def run(self) -> None:
        while self.running:
            busy = self.core.has_unfinished_requests()
            self._drain(0 if busy else _IDLE_POLL_MS)
            if os.getppid() != self.parent:
                return  # orphaned: the API process is gone
            outputs = self.core.step() if self.running else []
            idle = not self.core.has_unfinished_requests()
            if outputs or self.refused or (idle and self.stats_stale):
                # NOTE: the last message before going idle carries fresh stats (an abort of the
                # last request produces no output, but /metrics must see running == 0)
                wire = self.refused + [p.WireOutput.from_output(o) for o in outputs]
                self.refused = []
                self.stats_stale = not idle
                self.outbox.send(p.encode(p.StepOutputs(outputs=wire, stats=self._stats())))

    def _drain(self, timeout_ms: int) -> None:
        """Handle every message waiting in the inbox; wait up to timeout_ms for the first."""
        while self.running and self.poller.poll(timeout_ms):
            self._handle(p.decode_to_engine(self.inbox.recv()))
            timeout_ms = 0

    def _handle(self, msg: p.ToEngine) -> None:
        self.stats_stale |= isinstance(msg, (p.AddRequest, p.AbortRequests))
        if isinstance(msg, p.AddRequest):
            try:
                self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params.to_params())
            except ValueError as e:  # refused: only this request fails
                self.num_refused += 1
                self.refused.append(p.WireOutput(msg.request_id, [], finished=True,
                                                 finish_reason="abort", error=str(e)))
        elif isinstance(msg, p.AbortRequests):
            self.core.abort(msg.request_ids, FinishReason(msg.reason))
        elif isinstance(msg, p.Ping):
            self.outbox.send(p.encode(p.Pong(seq=msg.seq, stats=self._stats())))
        elif isinstance(msg, p.Shutdown):
            self.running = False

    def _stats(self) -> p.EngineStats:
        s, c = self.core.scheduler, self.core.counters
        return p.EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.stats.kv_usage,
            num_steps=s.stats.num_scheduled_steps, num_preemptions=s.stats.num_preemptions,
            num_prefix_hit_tokens=s.stats.num_prefix_hit_tokens,
            num_prompt_tokens=c.num_prompt_tokens, num_generated_tokens=c.num_generated_tokens,
            num_aborted=s.stats.num_aborted, num_refused=self.num_refused,
            step_seconds=c.last_step_seconds)
