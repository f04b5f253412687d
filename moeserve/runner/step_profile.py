"""Sampled step profile: where one engine step's device time goes.

Every `every`-th forward, CUDA events (host clocks on CPU) are recorded around the whole forward
and around each attention and each MoE block, through forward hooks that do nothing on other
steps. A sample is read one sampled step later, when its events have long completed, so profiling
never stalls the device:

    forward N (sampled)  -> events queued
    forward N + every    -> read sample N (event.elapsed_time: no wait), queue sample N + every

`latest` holds the last complete sample: forward, attention and MoE milliseconds, the rest of the
forward ("other"), and the step's token count. The engine adds its CPU scheduling time. A
CUDA-graph replay runs no hooks, so its sample has the forward's time only (attention and MoE
None); the breakdown comes from eagerly run steps.
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

    @property
    def other_ms(self) -> float | None:
        if self.attention_ms is None or self.moe_ms is None:
            return None
        return max(0.0, self.forward_ms - self.attention_ms - self.moe_ms)

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


class StepProfiler:
    def __init__(self, model: nn.Module, device: torch.device, every: int = 32):
        self.cuda = device.type == "cuda"
        self.every = every
        self.latest: StepSample | None = None
        self._count = 0
        self._active = False
        self._pending: tuple[int, _Clock, _Clock,
                             dict[str, list[tuple[_Clock, _Clock]]] | None] | None
        self._pending = None
        self._spans: dict[str, list[tuple[_Clock, _Clock]]] = {}
        self._start = self._end = None
        for module in model.modules():
            kind = _kind(module)
            if kind is not None:
                module.register_forward_pre_hook(self._pre_hook(kind))
                module.register_forward_hook(self._post_hook(kind))

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
            self._read_pending()
            self._spans = {}
            self._start = _Clock(self.cuda)
            self._start.record()

    def end(self, num_tokens: int, breakdown: bool = True) -> None:
        """After a forward (before sampling); `breakdown` False for a CUDA-graph replay, whose
        layers ran no hooks: only the whole forward is timed then."""
        if self._active:
            end = _Clock(self.cuda)
            end.record()
            self._pending = (num_tokens, self._start, end, self._spans if breakdown else None)
            self._active = False
            if not self.cuda:  # host clocks are final at once
                self._read_pending()

    def _read_pending(self) -> None:
        if self._pending is None:
            return
        num_tokens, start, end, spans = self._pending
        if self.cuda and not end.event.query():
            return  # not done yet (a long step): read it next time
        self._pending = None

        def total(kind: str) -> float | None:
            if spans is None:
                return None
            return sum(a.ms_until(b) for a, b in spans.get(kind, []))

        self.latest = StepSample(num_tokens, start.ms_until(end), total("attention"),
                                 total("moe"))


def _kind(module: nn.Module) -> str | None:
    from moeserve.layers.attention import Attention
    from moeserve.layers.moe import SparseMoeBlock

    if isinstance(module, Attention):
        return "attention"
    if isinstance(module, SparseMoeBlock):
        return "moe"
    return None
