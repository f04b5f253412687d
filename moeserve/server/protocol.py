"""The OpenAI wire protocol: pydantic models for requests and responses (and nothing else).

Requests are parsed strictly: a field we do not support is an error (`extra="forbid"`), a value
of the wrong JSON type is an error (`strict=True`: no "1" for 1, no 1.0 for an int), and every
number and list is bounded, so bad input gets a 400 naming the field before it reaches the engine.
A field OpenAI clients send with no effect here (`best_of` 1) is accepted at exactly that
value and refused otherwise. Tools, tool calls and
reasoning: server/agent/; `response_format` and `structured_outputs`: structured_output.py.
`docs/openai-compat.md` lists every field.

Every per-field limit lives in the field's type (bounds, `Literal`, `max_length`, a model), so the
JSON schema of these models (served at /openapi.json, server/openapi.py) shows exactly what is
accepted; field validators only reword errors. pydantic checks bool and int literals laxly even
in strict mode (`Literal[False]` takes 0, `Literal[1]` takes true and 1.0), so `best_of` is an int
bounded to [1, 1]. What a schema cannot say stays in the model validators (400s naming the
field): limits across fields (stream_options without stream, top_logprobs without logprobs,
echo with logprobs, seed + n - 1), and, in the routes, limits of the served model
(vocabulary, max_model_len, prompts x n).

The response models live in server/protocol_responses.py; this module re-exports them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from moeserve.server.agent.protocol import (
    MAX_TOOLS,
    ChatMessage,
    NamedToolChoice,
    Tool,
    ToolChoice,
)
from moeserve.server.protocol_responses import *  # noqa: F403  (the response models)
from moeserve.server.structured_output import ResponseFormat, StructuredOutputs
from moeserve.types import (
    LOGIT_BIAS_LIMIT,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    PENALTY_LIMIT,
    REPETITION_PENALTY_RANGE,
)

MAX_N = 8
MAX_CHOICES = 256  # prompts x n in one request
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 64
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Request(BaseModel):
    # NOTE: the attribute docstrings become the fields' descriptions in /openapi.json
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


# The error of a passive field at any other value (its type allows only the neutral one).
_NEUTRAL = {
    "best_of": "is not supported (only 1 or null is accepted)",
}


def _only_neutral(value: Any, handler: Any, info: ValidationInfo) -> Any:
    """A passive field's wrap validator: its type checks the value, this names the field's
    neutral values in the error."""
    try:
        return handler(value)
    except ValueError:
        raise ValueError(_NEUTRAL[str(info.field_name)]) from None


def _first_error(e: ValueError) -> str:
    """A logit_bias error's first problem: the key that is not a token id, or the bias (of
    which key) out of its range, or the map's size."""
    errors = getattr(e, "errors", None)
    if not callable(errors) or not errors():
        return str(e)
    first = errors()[0]
    loc = [str(p) for p in first["loc"]]
    if loc[-1:] == ["[key]"]:
        return f"{loc[0]!r} is not a token id"
    if loc:
        return f"{loc[0]!r}: {first['msg']}"
    return first["msg"]


class StreamOptions(_Request):
    include_usage: bool = False
    """Send a last chunk with `usage` and empty `choices` before [DONE]."""


class SamplingFields(_Request):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """vLLM's: EOS, stop_token_ids and stop strings end the reply only after this many tokens
    (at most the reply's max_tokens; not with a response_format or structured_outputs)."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    """One string or a list; each ends generation and is not included in the text."""
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    """vLLM's: the stop string that ended the reply stays at the end of its text."""
    allowed_token_ids: Annotated[list[TokenId], Field(
        min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    """vLLM's: the reply samples among these token ids alone."""
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (the EOS that ends a reply is left out either
    way). A request with tools keeps them when the model's tool-call markers are special."""
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None
    """vLLM's: keep the prompt's last N tokens (-1: as many as max_model_len allows, one less
    than it), before the length checks."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name each token "token_id:<id>" (a token whose bytes are not text on
    their own is then told apart)."""
    response_format: ResponseFormat | None = None
    """Hold the reply to JSON: {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}; {"type": "text"} holds it to nothing."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's structured outputs: exactly one of json, json_object, regex, choice, grammar."""
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")],
                               Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT,
                                                      le=LOGIT_BIAS_LIMIT)]],
                          Field(max_length=MAX_LOGIT_BIAS,
                                json_schema_extra={"additionalProperties": False})] | None = None
    """Token id (as a string) -> a bias in [-100, 100] added to that token's logit before
    sampling, greedy included: -100 all but bans the token, +100 all but forces it. The
    logprobs are of the biased logits."""
    frequency_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    """Subtracted from a token's logit once for every time the reply has used it so far."""
    presence_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)] | None = None
    """Subtracted from the logit of every token the reply has used so far."""
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0],
                                               le=REPETITION_PENALTY_RANGE[1])] | None = None
    """vLLM's (HF's): the logit of every token in the prompt or the reply so far divided by it
    where positive, multiplied where negative; 0.01..100, 1 is none."""

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _logit_bias(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValueError as e:
            raise ValueError(f"must map token ids (decimal strings) to numbers in "
                             f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], at most "
                             f"{MAX_LOGIT_BIAS} of them: {_first_error(e)}") from None

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs."""
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValueError:
            raise ValueError(f"must be a non-empty string or a list of at most {MAX_STOP} "
                             f"non-empty strings of at most {MAX_STOP_LEN} characters") from None

    @model_validator(mode="after")
    def _cross_field_checks(self) -> SamplingFields:
        # NOTE: messages of model validators start with the field's name: it becomes `param`.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed + n - 1 must be at most {INT64_MAX}")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("structured_outputs cannot be given beside a response_format other "
                             "than text (give one of them)")
        return self

    @property
    def constrains_format(self) -> bool:
        """response_format or structured_outputs holds the reply to a grammar."""
        return self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.type != "text")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Annotated[PromptInput, Field(examples=["Hello", [[1, 2, 3], [4, 5]]])]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    """Each choice's text begins with its prompt's (the text as sent, or a token-id prompt
    decoded); `token_ids` and the usage stay the completion's. With logprobs, the logprobs
    begin with the prompt's tokens (the first one's null), as OpenAI's legacy completions."""
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    """vLLM's: each choice's `prompt_logprobs`, one per prompt token (null for the first): the
    token's logprob after the ones before it and this many top ones, by token id."""
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> PromptInput:
        try:
            return handler(value)
        except ValueError:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                             "of token-id lists") from None

    @field_validator("best_of", mode="wrap")
    @classmethod
    def _passive_completion(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        return _only_neutral(value, handler, info)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The top logprobs each prompt token needs: prompt_logprobs', or logprobs' with echo."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if n is not None]
        return max(wanted) if wanted else None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(
        min_length=1, examples=[[{"role": "user", "content": "Hi"}]])]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    """Functions the model may call; its calls come back in `tool_calls` (server/agent/)."""
    tool_choice: ToolChoice | None = None
    """"auto" (the default with tools), "none", "required" (at least one call) or a named
    function (a call of it); the last two hold the reply to a JSON grammar of calls."""
    parallel_tool_calls: bool = True
    """false: at most one call per reply (the first the model writes)."""
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None
    """Extra variables for the chat template, such as {"enable_thinking": false}."""
    thinking_token_budget: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    """vLLM's: at most this many tokens of reasoning, then the reasoning's end marker is forced
    (-1 or unset: no budget); a 400 where the model's reasoning markers are not one token
    each."""

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_completion_tokens differs from max_tokens (give one of them)")
        if self.tools:
            names = [t.function.name for t in self.tools]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"tools names the function {twice[0]!r} twice")
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not self.tools:
                raise ValueError("tool_choice forces a call, but tools offers no function")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise ValueError(f"tool_choice names the function {choice.function.name!r}, "
                                 "which tools does not offer")
            if self.constrains_format:
                raise ValueError("tool_choice forces a call, which holds the reply to a grammar "
                                 "of calls: it cannot be given beside response_format or "
                                 "structured_outputs")
        elif self.tools and choice != "none" and self.constrains_format:
            raise ValueError("tools with response_format or structured_outputs: a reply held "
                             "to a format cannot also call tools in the model's own format; "
                             "send tool_choice \"none\", \"required\" or a named function")
        return self

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        """tool_choice "required" or a named function (the validator checked the tools)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
