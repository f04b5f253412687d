"""OpenAI's Responses API on the wire: pydantic models of a POST /v1/responses request (its input
items, function tools, text format, reasoning) and of the response object, its output items and
its stream events.

Parsed as strictly as the chat route (server/protocol.py): unknown fields are errors, numbers,
lists and strings are bounded; an input item or a tool of a kind this server cannot serve
(images, files, built-in tools: web search, file search, computer, shell, MCP, ...) is a 400
naming it. Output items come back as input items unchanged (Codex and the SDK send a turn's
items back whole), so the input models take the output items' fields (`id`, `status`,
`annotations`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moeserve.server.agent.protocol import MAX_ID_LEN, MAX_TOOLS, FunctionName
from moeserve.server.structured_output import JsonSchemaFormat

MAX_ITEMS = 4096  # input items, and content parts of one message
ItemId = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN)]
Status = Literal["in_progress", "completed", "incomplete"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


class InputText(_Request):
    type: Literal["input_text"]
    text: str


class OutputText(_Request):
    type: Literal["output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=0)] = []
    """Only [] (this server makes no annotations)."""
    logprobs: list[Any] | None = None


class Refusal(_Request):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]
_UNREADABLE = {"input_image": "an image (this server serves a text-only model)",
               "input_file": "a file (send its text as input_text)",
               "input_audio": "audio (this server serves a text-only model)"}


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_ITEMS)]
    id: ItemId | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: str
    """The arguments object as JSON text."""
    id: ItemId | None = None
    status: Status | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: ItemId
    output: str | Annotated[list[InputText], Field(max_length=MAX_ITEMS)]
    id: ItemId | None = None
    status: Status | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(
            p.text for p in self.output)


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Request):
    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: Annotated[list[SummaryText], Field(max_length=MAX_ITEMS)] = []
    content: Annotated[list[ReasoningText], Field(max_length=MAX_ITEMS)] | None = None
    encrypted_content: str | None = None
    """Accepted and left out (only OpenAI's models can read it; this server's reasoning comes
    back in clear, in `content`)."""
    status: Status | None = None

    @property
    def text(self) -> str:
        """The reasoning as the template shows earlier reasoning: its text, else its summary."""
        parts = self.content or self.summary
        return "\n".join(p.text for p in parts)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _with_message_type(value: Any) -> Any:
    """Input items: a bare {"role", "content"} is a message (the easy form); an item of a kind
    this server does not serve, or a content part it cannot read, gets an error naming it."""
    if not isinstance(value, list):
        return value
    out = []
    for i, item in enumerate(value):
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {**item, "type": "message"}
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in _ITEM_TYPES:
            raise ValueError(f"[{i}] is an item of type {kind!r}, which this server does not "
                             f"serve (it serves {', '.join(_ITEM_TYPES)})")
        parts = item.get("content") if kind == "message" else None
        for k, part in enumerate(parts if isinstance(parts, list) else ()):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part_kind, str) and part_kind in _UNREADABLE:
                raise ValueError(f"[{i}].content[{k}] is {_UNREADABLE[part_kind]}")
        out.append(item)
    return out


class FunctionTool(_Request):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (shown to the model by the chat template)."""
    strict: bool | None = None
    """Accepted; under tool_choice "auto" arguments are not held to the schema (with
    "required" or a named function they are: a JSON grammar of calls)."""


class NamedFunction(_Request):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaTextFormat(JsonSchemaFormat):
    """{"type": "json_schema", "name", "schema", "strict", "description"} (the chat route's
    json_schema, flattened)."""

    type: Literal["json_schema"]


class TextConfig(_Request):
    format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted (GPT-5's clients send it): the reply's length is the model's own."""


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """"none": the template's enable_thinking and thinking variables false; another level:
    true (the levels are not told apart); unset: the model's default."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted; the reasoning comes back whole, in the reasoning item's content."""


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    """A system message before the input (not carried over by previous_response_id)."""
    previous_response_id: ItemId | None = None
    """Continue a stored response: its input and output items come before this input."""
    store: bool = True
    """Keep this response (the most recent ones, in the store all the server's API processes
    share) for previous_response_id and GET /v1/responses/{id}."""
    background: bool = False
    """Answer at once ("queued") and generate in the server: poll GET /v1/responses/{id},
    end it early with POST /v1/responses/{id}/cancel. Needs store true. With stream: the
    events come as they are made, and GET ?stream=true&starting_after=N resumes them."""
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stream: bool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[Literal["reasoning.encrypted_content"]],
                       Field(max_length=4)] | None = None
    """Accepted: this server encrypts nothing (the reasoning is in the item's content)."""
    truncation: Literal["disabled"] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None
    """Accepted: every prompt's prefix is cached and reused by itself."""

    @field_validator("input", mode="before")
    @classmethod
    def _easy_messages(cls, value: Any) -> Any:
        return _with_message_type(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise ValueError(f"[{i}] is a tool of type {kind!r}: this server runs no "
                                     "built-in tools (only function tools)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools names the function {twice[0]!r} twice")
        if self.background and not self.store:
            raise ValueError("background needs store true: a background response is read "
                             "back from the store")
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedFunction)) and not names:
            raise ValueError("tool_choice forces a call, but tools offers no function")
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names the function {choice.name!r}, which tools "
                             "does not offer")
        return self


# ---- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class OutputTextOut(_Response):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningTextOut(_Response):
    type: Literal["reasoning_text"]
    text: str


class MessageOut(_Response):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Status
    content: list[OutputTextOut]


class ReasoningOut(_Response):
    id: str
    type: Literal["reasoning"]
    status: Status
    summary: list[Any]
    content: list[ReasoningTextOut]
    """The reasoning, whole and in clear."""


class FunctionCallOut(_Response):
    id: str
    type: Literal["function_call"]
    status: Status
    call_id: str
    name: str
    arguments: str


OutputItem = Annotated[MessageOut | ReasoningOut | FunctionCallOut, Field(discriminator="type")]


class InputTokensDetails(_Response):
    cached_tokens: int
    """Prompt tokens read from the prefix cache."""
    cache_write_tokens: int
    """Always 0 (the engine caches every prefix by itself)."""


class OutputTokensDetails(_Response):
    reasoning_tokens: int
    """The reasoning text's tokens (re-tokenized)."""


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseError(_Response):
    code: Literal["server_error", "invalid_prompt", "rate_limit_exceeded"]
    message: str


class ResponseObject(_Response):
    """The response: POST /v1/responses (whole, or "queued" with background), GET
    /v1/responses/{id}, POST .../cancel, and the `response` of the stream's lifecycle events
    (queued, in_progress: no output or usage yet)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseError | None
    """Why a background response failed."""
    background: bool
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class InputItemList(_Response):
    """GET /v1/responses/{id}/input_items: a page of the items the response took as input."""

    object: Literal["list"]
    data: list[InputItem]
    """The history it continued and its own input, each with its id (given, or the store's)."""
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(_Response):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class _Event(_Response):
    sequence_number: int


class LifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[OutputTextOut | ReasoningTextOut, Field(discriminator="type")]


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] | None = None
    """[] on output_text deltas."""


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str
    """The call's whole arguments (a call is sent once the model has written all of it)."""


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"]
    code: str
    message: str
    param: str | None


StreamEvent = (LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
               | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent | ErrorEvent)
