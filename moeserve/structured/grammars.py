"""The engine's grammars: a matcher per structured request, each step's token bitmask, and each
sampled token accepted.

    add(request_id, structured)     compile (ValueError: refused) -> the request's matcher
    rows(out)                       the step's rows that sample under an active grammar
    bitmask(out, rows)              [len(rows), ceil(V / 32)] int32, bit t of a row: token t
                                    allowed; and the requests whose grammar failed there (a
                                    parser limit: the request's grammar is at fault, a 400)
        = masks(out, rows) -> Masks: .compute() (may run on another thread), .finish()
    accept(outputs)                 each output's new tokens through its matcher ->
                                    ended (the grammar is complete: the request stops) or
                                    refused (the request fails: a token the mask did not allow,
                                    or one it allowed that broke a parser limit: GRAMMAR_FAILED)

A compiled grammar is kept by its text (a few most recent), and a request gets a copy: the
n choices of a request, and an agent's calls with the same tools, compile once. The vocabulary
(vocabulary.py) is built at the first structured request (about a second for 150k tokens).
A step's masks are built by one call of llguidance's executor on one thread of its own: the
rows in Rust with the GIL released, so the engine builds them on a thread of its own beside the
loop's other host work (engine/structured_steps.py). NOTE: per row that call is no cheaper than
one Python call a row, which holds the GIL between rows (a thread of those gets no overlap): on
the dev CPU at 1,024 rows about the same at the byte vocabulary, 1.7x dearer at a 115k BPE one
(21.9 against 12.9 ms median, benchmarks/results/structured_masks_thread/); so the overlap has
to pay for it. More executor threads did not pay (2 and 16 cores; gpu_ff7b345/).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moeserve.structured.spec import StructuredOutput
from moeserve.tokenizer import Tokenizer
from moeserve.types import RequestOutput, SchedulerOutput

COMPILED_KEPT = 64
MAX_WHY_CHARS = 300  # llguidance's errors quote the whole grammar: its first line, cut
GRAMMAR_FAILED = "structured output: the grammar cannot go on: "  # the API's 400s start so


@dataclass(slots=True)
class RequestGrammar:
    """One request's matcher; `waiting_for` the token after which it starts (or None)."""

    matcher: Any  # llguidance.LLMatcher
    waiting_for: int | None = None
    mask: np.ndarray | None = None  # what the grammar allowed at this step, until accepted

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, tokens: Sequence[int]) -> str | None:
        """Advance over sampled tokens; an error message when one was not allowed."""
        mask, self.mask = self.mask, None  # (a view of the step's mask array: let it go)
        for token in tokens:
            if self.waiting_for is not None:
                if token == self.waiting_for:
                    self.waiting_for = None
                continue
            if self.matcher.is_stopped():
                return None  # the grammar is complete; the engine stops the request
            if not self.matcher.consume_token(token):
                why = _first_line(self.matcher.get_error())
                if mask is not None and (int(mask[token >> 5]) >> (token & 31)) & 1:
                    return GRAMMAR_FAILED + why  # allowed, yet it broke the grammar: a limit
                return (f"the sampled token {token} is not allowed by the request's structured "
                        f"output: {why}")
        return None

    @property
    def ended(self) -> bool:
        return self.active and self.matcher.is_stopped()


@dataclass(slots=True)
class Accepted:
    """What `accept` found in a step's outputs."""

    ended: list[str] = field(default_factory=list)  # grammar complete: stop these requests
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why it fails


@dataclass(slots=True)
class Masks:
    """A step's masks being built (`Grammars.masks`): `compute` fills the array by one call of
    llguidance's executor, which releases the GIL; `finish` gives the array and the failures."""

    owner: Grammars
    mask: np.ndarray
    live: list[tuple[Any, int]]  # (matcher, row) of each row whose grammar goes on
    grammars: list[tuple[str, RequestGrammar]]  # (request id, its grammar) of each live row
    computed: bool = False

    def compute(self) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        if self.live:
            fill_next_token_bitmask_par(self.owner._executor, self.live, self.mask)
        self.computed = True

    def finish(self) -> tuple[np.ndarray, dict[str, str]]:
        """The array (each live row kept by its grammar until its token is accepted) and
        request id -> why its grammar failed (those are forgotten, their rows allow all)."""
        assert self.computed, "Masks.finish before compute"
        mask, failed = self.mask, {}
        for (matcher, j), (rid, grammar) in zip(self.live, self.grammars):
            grammar.mask = mask[j]  # a view, dropped once the step's tokens are accepted
            if matcher.is_error():
                mask[j] = -1
                failed[rid] = GRAMMAR_FAILED + _first_line(matcher.get_error())
                if self.owner._requests.get(rid) is grammar:  # (not dropped meanwhile)
                    del self.owner._requests[rid]
        return mask, failed


class Grammars:
    """The structured requests of one engine (see the module docstring)."""

    def __init__(self, tokenizer: Callable[[], Tokenizer], vocab_size: int,
                 eos_ids: Sequence[int]) -> None:
        self._load_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.words = (vocab_size + 31) // 32  # int32 words of a bitmask row (see add)
        self._llg_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._requests: dict[str, RequestGrammar] = {}
        self._executor: Any = None  # llguidance's LLExecutor, one thread (module docstring)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, structured: StructuredOutput) -> None:
        """Compile the request's grammar; ValueError naming the problem when it is refused."""
        from llguidance import LLMatcher

        grammar = structured.grammar()
        compiled = self._compiled.get(grammar)  # (validated when it was compiled)
        if compiled is None:
            structured.check()  # llguidance's own message for a bad grammar
            if self._llg_tokenizer is None:
                from moeserve.structured.vocabulary import grammar_tokenizer

                self._llg_tokenizer = grammar_tokenizer(self._load_tokenizer(),
                                                        self.vocab_size, self.eos_ids)
                # NOTE: with no EOS id, llguidance appends one past the model's ids: its rows
                # are a word longer then (the sampler reads the model's V bits of each)
                self.words = (max(self.vocab_size, self._llg_tokenizer.vocab_size) + 31) // 32
            compiled = LLMatcher(self._llg_tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"the {structured.kind} of the structured output cannot be "
                                 f"compiled: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        self._requests[request_id] = RequestGrammar(compiled.deep_copy(), structured.start_after)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def rows(self, out: SchedulerOutput) -> list[int]:
        """Rows of the step that sample under an active grammar."""
        if not self._requests:
            return []
        return [i for i, (rid, sample) in enumerate(zip(out.req_ids, out.sample))
                if sample and rid in self._requests and self._requests[rid].active]

    def bitmask(self, out: SchedulerOutput, rows: list[int], into: np.ndarray | None = None
                ) -> tuple[np.ndarray, dict[str, str]]:
        """[len(rows), words] int32: each row's allowed tokens; and request id -> why its
        grammar failed computing them (a parser limit). A row whose grammar is complete (its
        request stops at this step's update) or failed allows every token: it is dropped.
        `into`: the array to fill (an empty one of that shape), else a new one."""
        masks = self.masks(out, rows, into)
        masks.compute()
        return masks.finish()

    def masks(self, out: SchedulerOutput, rows: list[int], into: np.ndarray | None = None
              ) -> Masks:
        """`bitmask`'s masks in three parts: this (the engine's thread), `Masks.compute` (any
        thread: it touches the rows' matchers and the array alone) and `Masks.finish` (the
        engine's thread again, before the grammars change)."""
        # NOTE: np.empty: a row is written whole by llguidance, or set to -1 here (at 1,024 rows
        # of a 152k vocabulary np.full took 3.4 of 12.5 ms, a copy of each row 1.3)
        shape = (len(rows), self.words)
        if into is None:
            into = np.empty(shape, dtype=np.int32)
        elif into.shape != shape or into.dtype != np.int32 or not into.flags.c_contiguous:
            raise ValueError(f"the bitmask array must be C-contiguous int32 {shape}, got "
                             f"{into.dtype} {into.shape}")
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(1)
        live: list[tuple[Any, int]] = []
        grammars: list[tuple[str, RequestGrammar]] = []
        for j, i in enumerate(rows):
            rid = out.req_ids[i]
            grammar = self._requests[rid]
            if grammar.matcher.is_stopped():
                into[j] = -1
                continue
            live.append((grammar.matcher, j))
            grammars.append((rid, grammar))
        return Masks(self, into, live, grammars)

    def accept(self, outputs: list[RequestOutput]) -> Accepted:
        """Each output's new tokens through its request's matcher; finished requests dropped."""
        found = Accepted()
        if not self._requests:
            return found
        for out in outputs:
            grammar = self._requests.get(out.request_id)
            if grammar is None:
                continue
            error = grammar.accept(out.new_token_ids) if out.new_token_ids else None
            if out.finished:
                del self._requests[out.request_id]
            elif error is not None:
                found.refused[out.request_id] = error
            elif grammar.ended:
                found.ended.append(out.request_id)
        return found


def _first_line(error: str) -> str:
    return (error or "refused").splitlines()[0][:MAX_WHY_CHARS]
