"""Plain request-level data shared by the engine, scheduler and runner: no torch, no CUDA.

SamplingParams is what a caller asks for (validated here, once, so bad input never reaches the
step loop). SchedulerOutput is what the scheduler hands the runner each step, and ModelOutput is
what the runner hands back; both are flat lists of ints so the runner can build tensors from them
in a few vectorised calls. RequestOutput is what the engine reports to its caller per step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from moeserve.structured.spec import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids a request may bias (each costs host work every step)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias: [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's range for presence / frequency penalties: [-2, 2]
MAX_ALLOWED_TOKEN_IDS = 4096  # allowed_token_ids a request may give (host work every step)
# repetition_penalty's range: beyond it a logit divided by it could overflow the logits' dtype
REPETITION_PENALTY_RANGE = (0.01, 100.0)
GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy (vLLM's floor): dividing the
# logits by it would overflow fp32 (1e-39 gives inf logits and a NaN softmax)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Validated at construction: a bad value raises ValueError."""

    max_tokens: int = 16
    """Most tokens to generate (>= 1)."""
    min_tokens: int = 0
    """Fewest tokens to generate (0 <= min_tokens <= max_tokens) before EOS or a stop token id
    may be sampled (their logits are -inf until then) or a stop string may end the text (one
    must end in the text of a later token); a length limit still ends it (vLLM's)."""
    temperature: float = 1.0
    """0 means greedy; must be finite and >= 0; below 1e-5 it is greedy (stored as 0)."""
    top_p: float = 1.0
    """Nucleus mass in [0, 1]: the smallest set of most likely tokens whose probability reaches
    it; the most likely token is always kept (so 0, or a mass below any token's, keeps one)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top probability; in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same tokens whatever else is in the batch."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the stop string is not included in the text (unless
    include_stop_str_in_output)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the text at its end (vLLM's). Text side only."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS until max_tokens."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top logprobs (0..MAX_LOGPROBS)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob after the tokens before it (the first has none) and
    this many top logprobs (0..MAX_LOGPROBS), with the request's first output (vLLM's;
    sched/prompt_logprobs.py). Such a request reads no prefix-cache hit."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (the EOS or stop token that ends a request is left
    out either way). Text side only: the detokenizer reads it, the engine never sees it."""
    structured: StructuredOutput | None = None
    """Hold the output to a JSON schema, a regex, a choice or a grammar (structured/)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs (or a dict id -> bias): each bias, in [-100, 100], is added to its
    token's logit before sampling, greedy rows included (OpenAI's logit_bias; -100 all but bans
    a token, +100 all but forces it). At most MAX_LOGIT_BIAS distinct ids."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Sample only among these token ids (vLLM's; at most MAX_ALLOWED_TOKEN_IDS, non-empty):
    every other token's logit is -inf, greedy rows and logprobs included."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the request has generated (OpenAI's; in
    [-2, 2]; runner/penalties.py)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for every time the request has generated it
    (OpenAI's; in [-2, 2])."""
    repetition_penalty: float = 1.0
    """The logit of every token in the prompt or the output so far divided by it where
    positive, multiplied where negative (HF's and vLLM's; in REPETITION_PENALTY_RANGE, 1 is
    none)."""
    reasoning_budget: tuple[int, int, int] | None = None
    """(end token id, N, start token id or -1): at most N tokens of reasoning before its end
    token, the next then forced to be it (Anthropic's thinking budget_tokens). The reasoning
    is the output from its first token (start -1: the prompt opened it) or from the start
    token on (the model opens it; nothing is forced if it never does)."""
    edits_logits: bool = field(init=False, repr=False, compare=False, default=False)
    """Derived: allowed_token_ids, logit_bias, a penalty or min_tokens changes this request's
    logits before sampling (the sampler's one scan a step finds the rows that do)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = tuple(sorted(set(self.allowed_token_ids)))
            if not allowed or len(allowed) > MAX_ALLOWED_TOKEN_IDS or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} token "
                                 f"ids >= 0, got {self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-{PENALTY_LIMIT:g}, "
                                 f"{PENALTY_LIMIT:g}], got {value!r}")
            object.__setattr__(self, name, float(value))
        value, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not low <= value <= high:
            raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}], "
                             f"got {value!r}")
        object.__setattr__(self, "repetition_penalty", float(value))
        budget = self.reasoning_budget
        if budget is not None:
            budget = tuple(budget)
            if len(budget) != 3 or any(not isinstance(v, int) for v in budget) \
                    or budget[0] < 0 or budget[1] < 0 or budget[2] < -1:
                raise ValueError(f"reasoning_budget must be (end token id >= 0, tokens >= 0, "
                                 f"start token id >= 0 or -1), got {self.reasoning_budget!r}")
            object.__setattr__(self, "reasoning_budget", budget)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got "
                             f"{type(self.structured).__name__}")
        if budget is not None and self.allowed_token_ids is not None \
                and budget[0] not in self.allowed_token_ids:
            raise ValueError(f"allowed_token_ids must hold the reasoning budget's end token "
                             f"{budget[0]}, which the budget forces")
        if self.structured is not None and self.allowed_token_ids is not None:
            raise ValueError("allowed_token_ids cannot be combined with a structured output "
                             "(the grammar decides which tokens are allowed)")
        if self.structured is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a structured output (a "
                             "grammar that is complete allows EOS alone)")
        object.__setattr__(self, "edits_logits", bool(
            self.allowed_token_ids or self.logit_bias or self.min_tokens
            or self.presence_penalty or self.frequency_penalty
            or self.repetition_penalty != 1.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias as sorted (id, bias) pairs; ValueError naming what is wrong."""
    pairs = list(value.items()) if isinstance(value, dict) else list(value)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} tokens; at most {MAX_LOGIT_BIAS}")
    out = []
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        token, bias = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                             f"{LOGIT_BIAS_LIMIT:g}], got {bias!r} for token {token}")
        out.append((token, float(bias)))
    out.sort()
    if any(a[0] == b[0] for a, b in zip(out, out[1:])):
        raise ValueError("logit_bias names a token id twice")
    return tuple(out)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the caller (or the client went away)
    ERROR = "error"  # a fault of this request alone in the engine step (RequestOutput.error)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan, in batch order. Only ints and lists: the runner builds the tensors.

    Row i is request `req_ids[i]`; it computes `num_scheduled_tokens[i]` tokens starting at
    position `num_computed_tokens[i]`; their ids are the i-th slice of the flat `token_ids`.
    `sample[i]` is True when the row's chunk reaches the end of its known tokens, so the runner
    samples a new token for it (a prefill chunk that stops short of the prompt's end does not).
    """

    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # flat, sum(num_scheduled_tokens) long
    block_tables: list[list[int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    sampling_params: list[SamplingParams] = field(default_factory=list)
    sample_seeds: list[int] = field(default_factory=list)  # per row; resolved seed of the request
    num_output_tokens: list[int] = field(default_factory=list)  # per row; outputs so far
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # freed since the last step
    num_prefix_hit_tokens: int = 0  # tokens served from the prefix cache this step
    num_steps: int = 1  # decode-only steps run back to back (num_continuous_decode_steps)
    grammar_rows: list[int] = field(default_factory=list)  # rows sampling under a grammar
    grammar_bitmask: Any = None  # [len(grammar_rows), ceil(V / 32)] int32: bit t of a row set
    # when token t is allowed (structured/grammars.py); None without grammar rows. A np.ndarray,
    # or on CUDA a pinned torch tensor (engine/structured_steps.py)
    # prompt logprobs to compute (sched/prompt_logprobs.py): (row, first entry k, count) each,
    # entry k from the logits of the row's position k - 1, its target prompt[k], flat in order
    prompt_logprob_spans: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # (row, its prompt's token ids) of requests with a repetition penalty, in the first plan
    # that schedules them (the runner keeps the prompt's tokens until they finish)
    penalty_prompts: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities for one sampled token."""

    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class ModelOutput:
    """What the runner returns: one sampled token per row with `sample` True, in row order,
    -1 for rows that did not sample; logprobs per row where asked, else None. `row_errors`:
    rows whose own fault (non-finite logits, a sampler error of that row alone) failed them, with
    what happened; their tokens are placeholders that the scheduler discards."""

    sampled_token_ids: list[int]
    logprobs: list[Logprobs | None] | None = None
    extra_token_ids: list[list[int]] | None = None  # per row, steps 2..num_steps
    row_errors: dict[int, str] | None = None
    # per plan span (SchedulerOutput.prompt_logprob_spans), its entries in order
    prompt_logprobs: list[list[Logprobs]] | None = None
    # ids of this step's forwards the step profiler timed (runner/step_profile.py): the engine
    # hands them back with the step's wall time
    profiled_forwards: tuple[int, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """What the engine reports for one request after a step (or at the end, from LLM.generate)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # this step's tokens (or all tokens, from LLM.generate)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or id that ended it
    text: str = ""
    logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why it was refused (finish "abort") or failed (finish "error")
    # prompt entries not reported before (SamplingParams.prompt_logprobs): with the request's
    # first output they start at prompt[1]
    prompt_logprobs: list[Logprobs] | None = None
