"""A launched step's sampled tokens: on the device until `result()` reads them on the host.

The runner returns one per launch (overlap scheduling keeps one in flight while the next step
is planned); `start_copy` enqueues the tokens' copy to pinned host memory right behind the step,
so `result()` waits for that step alone.
"""

from __future__ import annotations

import numpy as np
import torch

from moeserve.layers.sampler import SampleLogprobs
from moeserve.runner.prompt_logprobs import split_entries
from moeserve.runner.step_sampling import StepSample
from moeserve.types import Logprobs, ModelOutput, SamplingParams, SchedulerOutput


class PendingOutput:
    """One launched step's sampled tokens, still on the device until `result()`."""

    def __init__(self, num_reqs: int, rows: np.ndarray):
        self.num_reqs = num_reqs
        self.rows = rows  # [R] rows of the step that sample
        self.params: list[SamplingParams] = []
        self.token_ids: torch.Tensor | None = None  # [R] int64, on the device
        self.extra_token_ids: torch.Tensor | None = None  # [R, steps - 1], multi-step decode
        self.logprobs = None  # SampleLogprobs | None
        self.finite: torch.Tensor | None = None  # [R] bool, False: the row's logits not finite
        self.row_errors: dict[int, str] = {}  # row (of R) -> a fault of that row alone
        self.profiled_forwards: tuple[int, ...] = ()  # the step profiler's timed forwards
        # (picked hidden rows [R, hidden], positions [R]) until the rows are sampled: a launch
        # with defer_sampling keeps them for ModelRunner.sample_deferred
        self.deferred: tuple[torch.Tensor, list[int]] | None = None
        # the plan's prompt logprobs ([N] in span order: runner/prompt_logprobs.py), its plan
        self.prompt_logprobs: tuple[SampleLogprobs, SchedulerOutput] | None = None
        self._copied: torch.cuda.Event | None = None  # start_copy's end, on CUDA
        self._host: tuple = ()  # start_copy's pinned (token_ids, extra ids, logprobs, finite)

    def take(self, step: StepSample, first: bool = True) -> None:
        """Keep a sample_step's result: the first step's tokens and logprobs; every step's
        finite flags and row errors (multi-step decode: a row that fails in any step fails)."""
        if first:
            self.token_ids, self.logprobs = step.token_ids, step.logprobs
        self.finite = step.finite if self.finite is None else self.finite & step.finite
        for row, error in step.row_errors.items():
            self.row_errors.setdefault(row, error)

    def start_copy(self) -> None:
        """On CUDA, enqueue the copy of the sampled tokens (and logprobs) into pinned host
        memory now, behind this step's kernels, and mark its end with an event.

        NOTE: without it, `result()` would copy with `.tolist()` when called; in overlap
        scheduling that is after step N+1 was launched on the same stream, so the copy (and
        the host) would wait for step N+1's whole forward, and the GPU would then idle while
        the host planned step N+2: overlap lost (~10 ms a step at 1,024 requests on the H200).
        """
        if self.prompt_logprobs is not None and self.prompt_logprobs[0].top_ids.is_cuda:
            lps, plan = self.prompt_logprobs
            self.prompt_logprobs = (_logprobs_to_host(lps), plan)
            self._copied = torch.cuda.Event()
            self._copied.record()
        if self.token_ids is None or self.token_ids.device.type != "cuda":
            return
        # the device tensors stay: the next launch reads its -1 placeholders from token_ids
        lp = self.logprobs
        self._host = (_to_host_async(self.token_ids),
                      None if self.extra_token_ids is None
                      else _to_host_async(self.extra_token_ids),
                      None if lp is None else _logprobs_to_host(lp),
                      None if self.finite is None else _to_host_async(self.finite))
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> ModelOutput:
        """Wait for the step (the host sync) and return its ModelOutput."""
        sampled = [-1] * self.num_reqs
        if self._copied is not None:
            self._copied.synchronize()  # this step's copies only, not later launches
        prompt = None if self.prompt_logprobs is None else split_entries(
            self.prompt_logprobs[1], self.prompt_logprobs[0])
        if self.token_ids is None:
            return ModelOutput(sampled_token_ids=sampled, prompt_logprobs=prompt,
                               profiled_forwards=self.profiled_forwards)
        token_ids, extra_ids, logprobs, finite = (self.token_ids, self.extra_token_ids,
                                                  self.logprobs, self.finite)
        if self._copied is not None:
            token_ids, extra_ids, logprobs, finite = self._host
        rows = self.rows.tolist()
        for i, tok in zip(rows, token_ids.tolist()):
            sampled[i] = tok
        extra = None if extra_ids is None else extra_ids.tolist()
        return ModelOutput(sampled_token_ids=sampled, logprobs=self._logprobs(logprobs),
                           extra_token_ids=extra, row_errors=self._row_errors(rows, finite),
                           profiled_forwards=self.profiled_forwards, prompt_logprobs=prompt)

    def _row_errors(self, rows: list[int], finite: torch.Tensor | None) -> dict[int, str] | None:
        """Batch row -> what failed, for the rows with a fault of their own; None when none."""
        errors = {rows[j]: e for j, e in self.row_errors.items()}
        if finite is not None and not bool(finite.all()):
            for j in torch.nonzero(~finite).flatten().tolist():
                errors.setdefault(rows[j], "the model's logits for this request are not "
                                           "finite (NaN or infinite)")
        return errors or None

    def _logprobs(self, lps: SampleLogprobs | None) -> list[Logprobs | None] | None:
        if lps is None:
            return None
        result: list[Logprobs | None] = [None] * self.num_reqs
        token_lp = lps.token_logprob.tolist()
        top_ids, top_lps = lps.top_ids.tolist(), lps.top_logprobs.tolist()
        for j, (row, p) in enumerate(zip(self.rows.tolist(), self.params)):
            if p.logprobs is not None:
                # the top n, less those a grammar forbade (-inf: they sort last)
                top = top_lps[j][:p.logprobs]
                n = next((k for k, lp in enumerate(top) if lp == _NEG_INF), len(top))
                result[row] = Logprobs(token_lp[j], top_ids[j][:n], top[:n])
        return result


_NEG_INF = float("-inf")


def _logprobs_to_host(lp: SampleLogprobs) -> SampleLogprobs:
    return SampleLogprobs(_to_host_async(lp.token_logprob), _to_host_async(lp.top_ids),
                          _to_host_async(lp.top_logprobs))


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that `t` is being copied into, on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
