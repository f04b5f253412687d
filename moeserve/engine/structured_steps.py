"""Structured outputs in the engine's step loop (the grammars themselves: structured/grammars.py).

    add_request   the request's grammar compiled; a bad one refuses the request (ValueError)
    step          schedule -> launch -> [needs_tokens: N+1's forward enqueued, its sampling
                  deferred; step N settles; `begin`: N+1's masks built on the masks thread
                  while the loop sends N's outputs, takes requests in and plans N+2] ->
                  next step: schedule N+2 -> `finish` (N+1's masks into its plan) -> N+1
                  sampled -> N+2 launched -> ...
                  settle (each sampled token accepted: a complete grammar stops its request,
                  a refused token fails it; the token is dropped)
    abort         the grammar dropped with the request

Overlap scheduling plans step N+1 before step N's tokens reach the host; a grammar row of N+1
needs its token of N for its mask. So such a step's forward is enqueued first, step N's tokens
are read and accepted while it runs, and its masks are built on a thread of their own (one call
of llguidance's executor, which releases the GIL) while the engine's thread goes on with the
loop; N+1 is sampled once they exist, before N+2 is launched on its tokens: the device waits only
if building the masks outlasts the forward (`num_overlap_waits` counts these steps). Several
ranks sample inside their launch: there step N settles before N+1 launches, the masks are built
on the engine's thread, and the batch loses its overlap on those steps.

On CUDA the masks are written into page-locked host memory (torch's caching host allocator), so
the sampler's copy to the device neither stages nor copies them first.

Reasoning budgets (structured/budgets.py) share the masks: a row whose budget is used up is put
after the grammar rows with a mask of its end token alone, and a row whose budget may run out
at this step makes it wait for the step before, as a grammar row does.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from moeserve import envs
from moeserve.config import EngineConfig
from moeserve.model_config import ModelConfig
from moeserve.sched import Scheduler
from moeserve.structured.budgets import ReasoningBudgets
from moeserve.structured.grammars import GRAMMAR_FAILED, Grammars, Masks
from moeserve.tokenizer import load_model_tokenizer
from moeserve.types import FinishReason, RequestOutput, SamplingParams, SchedulerOutput


class StructuredSteps:
    """The engine's structured requests (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig) -> None:
        self.grammars = Grammars(
            lambda: load_model_tokenizer(cfg.model, cfg.tokenizer, model_config),
            model_config.vocab_size, model_config.eos_token_ids)
        self.budgets = ReasoningBudgets()
        self.num_ended = 0  # requests stopped by their grammar's end
        self.num_refused_tokens = 0  # requests failed by a token their mask did not allow
        self.num_grammar_failures = 0  # requests failed by their grammar (a parser limit)
        self.num_overlap_waits = 0  # steps sampled after the step in flight settled
        # (needs_tokens; one rank: its forward enqueued before, so overlap is kept)
        self.pinned = torch.device(cfg.device).type == "cuda"  # masks in page-locked memory
        self.on_thread = envs.grammar_masks_thread()  # else at once (MOESERVE_GRAMMAR_MASKS_THREAD)
        self._thread: ThreadPoolExecutor | None = None  # the masks thread, started at first use
        # the plan in flight whose sampling waits for its masks (begin -> finish); the future
        # of the masks thread's work, None when built at once
        self._deferred: tuple[SchedulerOutput, Masks | None, Future | None] | None = None

    @property
    def deferred(self) -> bool:
        """A launched step's sampling waits for `finish` (its masks being built)."""
        return self._deferred is not None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def add(self, request_id: str, params: SamplingParams) -> None:
        if params.structured is not None:
            self.grammars.add(request_id, params.structured)
        if params.reasoning_budget is not None:
            self.budgets.add(request_id, *params.reasoning_budget)

    def drop(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.grammars.drop(request_ids)
        self.budgets.drop(request_ids)

    def needs_tokens(self, out: SchedulerOutput) -> bool:
        """A row of the plan samples under a grammar (waiting for its start token or not), or
        its reasoning budget may run out at it: its mask needs every earlier token of its
        request on the host."""
        grammars, budgets = self.grammars, self.budgets
        return (len(grammars) > 0 or len(budgets) > 0) and any(
            sample and (rid in grammars or budgets.near(rid))
            for rid, sample in zip(out.req_ids, out.sample))

    def prepare(self, out: SchedulerOutput, scheduler: Scheduler) -> list[RequestOutput]:
        """Put the step's grammar rows and their bitmask into the plan; the requests whose
        grammar failed computing its mask fail now (their rows' tokens are dropped)."""
        rows, array = self._rows(out)
        if not rows:  # (forced rows alone: their masks are filled)
            return []
        return self._failures(self.grammars.bitmask(out, rows, array[:len(rows)])[1], scheduler)

    def begin(self, out: SchedulerOutput) -> None:
        """`prepare` for a launched step whose sampling was deferred: its rows now, its masks on
        the masks thread (MOESERVE_GRAMMAR_MASKS_THREAD=0: at once, here); `finish` puts them
        into the plan before it is sampled."""
        assert self._deferred is None, "begin with a step's masks still unfinished"
        rows, array = self._rows(out)
        masks = self.grammars.masks(out, rows, array[:len(rows)]) if rows else None
        future = None
        if masks is not None and self.on_thread:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="moeserve-masks")
            future = self._thread.submit(masks.compute)
        elif masks is not None:
            masks.compute()
        self._deferred = (out, masks, future)

    def finish(self, scheduler: Scheduler) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """The deferred step's plan, its masks in it, and the outputs of the requests whose
        grammar failed computing them (as `prepare`'s)."""
        assert self._deferred is not None, "finish with no step begun"
        (out, masks, future), self._deferred = self._deferred, None
        if masks is None:
            return out, []
        if future is not None:
            future.result()  # (raises what compute raised)
        return out, self._failures(masks.finish()[1], scheduler)

    def _rows(self, out: SchedulerOutput) -> tuple[list[int], np.ndarray | None]:
        """The plan's grammar rows, then its forced rows (a reasoning budget used up: their
        masks filled here) into `out`, and the masks' array (None without rows); the grammar
        rows' masks are its first rows."""
        rows = self.grammars.rows(out)
        forced = self.budgets.forced(out, rows)
        out.grammar_rows = rows + forced
        if not out.grammar_rows:
            out.grammar_bitmask = None
            return rows, None
        array, out.grammar_bitmask = self._host_array(len(out.grammar_rows))
        if forced:
            self.budgets.fill(array[len(rows):], [out.req_ids[i] for i in forced])
        return rows, array

    def _host_array(self, rows: int) -> tuple[np.ndarray, Any]:
        """An empty [rows, words] int32 array for the masks, and what the plan carries to the
        sampler: page-locked on CUDA (a torch tensor the array views: torch's host allocator
        reuses its memory only once the copies enqueued from it have run), else the array."""
        shape = (rows, self.grammars.words)
        if not self.pinned:
            array = np.empty(shape, dtype=np.int32)
            return array, array
        tensor = torch.empty(shape, dtype=torch.int32, pin_memory=True)
        return tensor.numpy(), tensor

    def _failures(self, failed: dict[str, str], scheduler: Scheduler) -> list[RequestOutput]:
        self.num_grammar_failures += len(failed)
        return [o for rid, why in failed.items()
                if (o := scheduler.fail_request(rid, why)) is not None]

    def settle(self, outputs: list[RequestOutput], scheduler: Scheduler) -> list[RequestOutput]:
        """Accept a step's tokens; stop the requests whose grammar is complete and fail those
        that sampled a token it refuses (in `outputs`, which are returned)."""
        self.budgets.accept(outputs)
        found = self.grammars.accept(outputs)
        if not found.ended and not found.refused:
            return outputs
        scheduler.finish_requests(found.ended, FinishReason.STOP)
        self.grammars.drop(found.ended)
        self.num_ended += len(found.ended)
        ended = set(found.ended)
        settled = []
        for out in outputs:
            if out.request_id in ended:
                out.finished, out.finish_reason = True, FinishReason.STOP
            elif out.request_id in found.refused:
                why = found.refused[out.request_id]
                failed = scheduler.fail_request(out.request_id, why)
                self.grammars.drop([out.request_id])
                if why.startswith(GRAMMAR_FAILED):
                    self.num_grammar_failures += 1
                else:
                    self.num_refused_tokens += 1
                if failed is None:
                    continue
                out = failed
            settled.append(out)
        return settled
