"""Structured outputs in the engine's step loop (the grammars themselves: structured/grammars.py).

    add_request   the request's grammar compiled; a bad one refuses the request (ValueError)
    step          schedule -> launch -> [needs_tokens: N+1's forward enqueued, its sampling
                  deferred; step N settles] -> prepare (N+1's bitmask into the plan) ->
                  sample -> update -> settle (each sampled token accepted: a complete grammar
                  stops its request, a refused token fails it; the token is dropped)
    abort         the grammar dropped with the request

Overlap scheduling plans step N+1 before step N's tokens reach the host; a grammar row of N+1
needs its token of N for its mask. So such a step's forward is enqueued first, step N's tokens
are read and accepted while it runs, and its sampling is enqueued once the masks exist: the
device waits only if building the masks outlasts the forward (`num_overlap_waits` counts these
steps). Several ranks sample inside their launch: there step N settles before N+1 launches,
and the batch loses its overlap on those steps.
"""

from __future__ import annotations

from collections.abc import Iterable

from moeserve.config import EngineConfig
from moeserve.model_config import ModelConfig
from moeserve.sched import Scheduler
from moeserve.structured.grammars import GRAMMAR_FAILED, Grammars
from moeserve.tokenizer import load_model_tokenizer
from moeserve.types import FinishReason, RequestOutput, SamplingParams, SchedulerOutput


class StructuredSteps:
    """The engine's structured requests (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig) -> None:
        self.grammars = Grammars(
            lambda: load_model_tokenizer(cfg.model, cfg.tokenizer, model_config),
            model_config.vocab_size, model_config.eos_token_ids)
        self.num_ended = 0  # requests stopped by their grammar's end
        self.num_refused_tokens = 0  # requests failed by a token their mask did not allow
        self.num_grammar_failures = 0  # requests failed by their grammar (a parser limit)
        self.num_overlap_waits = 0  # steps sampled after the step in flight settled
        # (needs_tokens; one rank: its forward enqueued before, so overlap is kept)

    def add(self, request_id: str, params: SamplingParams) -> None:
        if params.structured is not None:
            self.grammars.add(request_id, params.structured)

    def drop(self, request_ids: Iterable[str]) -> None:
        self.grammars.drop(request_ids)

    def needs_tokens(self, out: SchedulerOutput) -> bool:
        """A row of the plan samples under a grammar (waiting for its start token or not): its
        mask needs every earlier token of its request on the host."""
        grammars = self.grammars
        return len(grammars) > 0 and any(
            sample and rid in grammars for rid, sample in zip(out.req_ids, out.sample))

    def prepare(self, out: SchedulerOutput, scheduler: Scheduler) -> list[RequestOutput]:
        """Put the step's grammar rows and their bitmask into the plan; the requests whose
        grammar failed computing its mask fail now (their rows' tokens are dropped)."""
        rows = self.grammars.rows(out)
        out.grammar_rows = rows
        if not rows:
            out.grammar_bitmask = None
            return []
        out.grammar_bitmask, failed = self.grammars.bitmask(out, rows)
        self.num_grammar_failures += len(failed)
        return [o for rid, why in failed.items()
                if (o := scheduler.fail_request(rid, why)) is not None]

    def settle(self, outputs: list[RequestOutput], scheduler: Scheduler) -> list[RequestOutput]:
        """Accept a step's tokens; stop the requests whose grammar is complete and fail those
        that sampled a token it refuses (in `outputs`, which are returned)."""
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
