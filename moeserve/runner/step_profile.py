"""Sampled step profile: where one engine step's device time goes.

Every `every`-th forward, CUDA events (host clocks on CPU) are recorded around the whole forward
and around each attention and each MoE block, through forward hooks that do nothing on other
steps, and under tensor parallelism around each collective (the all-reduces and the logits'
all-gather: `comm`, through the model's TensorParallel hooks). A sample is read one sampled
step later, when its events have long completed, so profiling never stalls the device:

    forward N (sampled)  -> events queued
    forward N + every    -> read sample N (event.elapsed_time: no wait), queue sample N + every

`latest` holds the last complete sample: forward, attention and MoE milliseconds, the rest of the
forward ("other"), and the step's token count. The engine adds its CPU scheduling time. A
CUDA-graph replay runs no hooks, so its sample has the forward's time only (attention and MoE
None); the breakdown comes from eagerly run steps.

Cumulative and count-uniform beside it (the doctor compares them; a gauge such as `latest`, read
when a stats request happens to be answered, is not count-uniform): each sampled forward's id
goes with its step's output (`take_sampled`, ModelOutput.profiled_forwards), and the engine hands
back that step's wall seconds per forward (`add_step_wall`). A sample with both joins the totals:

    num_profiled_forwards          sampled forwards with their device time and their step's wall
    profiled_device_seconds_total  their device seconds (CUDA events; host clocks on CPU)
    profiled_wall_seconds_total    their engine steps' wall seconds, per forward of each step

so wall / device over the same forwards says how much longer a step takes than its device work.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(slots=True)
class StepSample:
    num_tokens: int
    forward_ms: float
    attention_ms: float | None  # None: a CUDA-graph replay (no per-layer events inside)
    moe_ms: float | None
    comm_ms: float | None = None  # the collectives (tensor parallelism; None on one rank)

    @property
    def other_ms(self) -> float | None:
        if self.attention_ms is None or self.moe_ms is None:
            return None
        return max(0.0, self.forward_ms - self.attention_ms - self.moe_ms
                   - (self.comm_ms or 0.0))

    def to_dict(self) -> dict:
        return asdict(self) | {"other_ms": self.other_ms}


class _Clock:
    """A CUDA event on the GPU, a host timestamp on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = 0.0

    def record(self) -> None:
        if self.cuda:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_until(self, other: _Clock) -> float:
        return self.event.elapsed_time(other.event) if self.cuda else (other.t - self.t) * 1e3


MAX_OPEN_SAMPLES = 64  # samples waiting for their device time or their step's wall time


@dataclass(slots=True)
class _Timed:
    """One sampled forward, until its device time and its engine step's wall time are known."""

    num_tokens: int
    start: _Clock
    end: _Clock
    spans: dict[str, list[tuple[_Clock, _Clock]]] | None  # None: a graph replay
    device_s: float | None = None  # read from the clocks once they completed
    wall_s: float | None = None  # the step's wall seconds per forward (add_step_wall)


class StepProfiler:
    def __init__(self, model: nn.Module, device: torch.device, every: int = 32):
        self.cuda = device.type == "cuda"
        self.every = every
        self.latest: StepSample | None = None
        self._count = 0
        self._active = False
        self._open: dict[int, _Timed] = {}  # forward id -> its sample, in launch order
        self._sampled: list[int] = []  # forward ids sampled since the last take_sampled()
        self._spans: dict[str, list[tuple[_Clock, _Clock]]] = {}
        self._start: _Clock | None = None
        self.reset_counters()
        for module in model.modules():
            kind = _kind(module)
            if kind is not None:
                module.register_forward_pre_hook(self._pre_hook(kind))
                module.register_forward_hook(self._post_hook(kind))
        tp = getattr(model, "tp", None)
        self.parallel = tp is not None
        if tp is not None:
            pre, post = self._pre_hook("comm"), self._post_hook("comm")
            tp.hooks = (lambda: pre(model, ()), lambda: post(model, (), None))

    def reset_counters(self) -> None:
        """Zero the totals and forget open samples (serving starts now: warm-up and graph
        capture ran forwards that no engine step will claim)."""
        self.num_profiled_forwards = 0
        self.profiled_device_seconds_total = 0.0
        self.profiled_wall_seconds_total = 0.0
        self._open.clear()
        self._sampled.clear()

    def _pre_hook(self, kind: str):
        def hook(_module: nn.Module, _args: tuple) -> None:
            if self._active:
                clock = _Clock(self.cuda)
                clock.record()
                self._spans.setdefault(kind, []).append((clock, clock))
        return hook

    def _post_hook(self, kind: str):
        def hook(_module: nn.Module, _args: tuple, _out: object) -> None:
            if self._active:
                clock = _Clock(self.cuda)
                clock.record()
                start, _ = self._spans[kind][-1]
                self._spans[kind][-1] = (start, clock)
        return hook

    def begin(self) -> None:
        """Before a forward: decide whether this one is sampled."""
        self._active = self._count % self.every == 0
        self._count += 1
        if self._active:
            self._read_done()
            self._spans = {}
            self._start = _Clock(self.cuda)
            self._start.record()

    def end(self, num_tokens: int, breakdown: bool = True) -> None:
        """After a forward (before sampling); `breakdown` False for a CUDA-graph replay, whose
        layers ran no hooks: only the whole forward is timed then."""
        if self._active:
            end = _Clock(self.cuda)
            end.record()
            forward_id = self._count - 1
            self._open[forward_id] = _Timed(num_tokens, self._start, end,
                                            self._spans if breakdown else None)
            self._sampled.append(forward_id)
            while len(self._open) > MAX_OPEN_SAMPLES:  # never claimed by a step: dropped
                del self._open[next(iter(self._open))]
            self._active = False
            if not self.cuda:  # host clocks are final at once
                self._read_done()

    def take_sampled(self) -> tuple[int, ...]:
        """The ids of the forwards sampled since the last call: the runner attaches them to
        the step's output, and the engine returns them with the step's wall time."""
        ids, self._sampled = tuple(self._sampled), []
        return ids

    def add_step_wall(self, forward_ids: tuple[int, ...], seconds_per_forward: float) -> None:
        """The wall seconds per forward of the engine step that ran (and waited for) these
        sampled forwards: core.step() over the forwards of its plan."""
        for forward_id in forward_ids:
            timed = self._open.get(forward_id)
            if timed is not None:
                timed.wall_s = seconds_per_forward
        self._read_done()

    def _read_done(self) -> None:
        """Read every open sample whose clocks completed (in launch order; on CUDA a later
        one cannot be done before an earlier one), and total those whose wall is known."""
        for forward_id, timed in list(self._open.items()):
            if timed.device_s is None:
                if self.cuda and not timed.end.event.query():
                    break  # not done yet (a long step): read it next time
                self._read(timed)
            if timed.wall_s is not None:
                self.num_profiled_forwards += 1
                self.profiled_device_seconds_total += timed.device_s
                self.profiled_wall_seconds_total += timed.wall_s
                del self._open[forward_id]

    def _read(self, timed: _Timed) -> None:
        spans = timed.spans

        def total(kind: str) -> float | None:
            if spans is None:
                return None
            return sum(a.ms_until(b) for a, b in spans.get(kind, []))

        forward_ms = timed.start.ms_until(timed.end)
        timed.device_s = forward_ms / 1e3
        timed.spans = None  # the events are read: let them go
        self.latest = StepSample(timed.num_tokens, forward_ms, total("attention"), total("moe"),
                                 total("comm") if self.parallel else None)


def _kind(module: nn.Module) -> str | None:
    from moeserve.layers.attention import Attention
    from moeserve.layers.mla import MLAttention
    from moeserve.layers.moe import SparseMoeBlock

    if isinstance(module, Attention | MLAttention):
        return "attention"
    if isinstance(module, SparseMoeBlock):
        return "moe"
    return None
