"""Anthropic's Messages API on the wire: pydantic models of POST /v1/messages and
/v1/messages/count_tokens requests, and of their responses and stream events.

Parsed as strictly as the OpenAI routes (server/protocol.py): unknown fields are errors, every
number, list and string is bounded, and a content block of a kind this server cannot read (an
image, a document, a server tool's result) is a 400 naming it. Blocks and tools may carry
`cache_control` ({"type": "ephemeral"}): accepted, with no effect beyond what the engine does
anyway (every prompt's prefix is cached and reused automatically). `redacted_thinking` blocks
(reasoning only Anthropic's models can read) are accepted and left out of the prompt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moeserve.server.agent.protocol import MAX_ID_LEN, MAX_TOOL_CALLS, MAX_TOOLS
from moeserve.server.protocol import INT32_MAX, MAX_STOP, MAX_STOP_LEN

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
BlockId = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN)]
MAX_BLOCKS = 4096  # content blocks in one message
MIN_THINKING_BUDGET = 1024  # Anthropic's own minimum


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[Any], Field(max_length=0)] | None = None
    """Only null or [] (this server makes no citations)."""


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    """Accepted and not checked (this server signs nothing: its own are "")."""


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: BlockId
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: BlockId
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool = False
    """true: the tool failed; the model sees its content led by "Error: "."""
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "\n".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock
                  | ToolResultBlock, Field(discriminator="type")]
_BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
_UNREADABLE = {"image": "an image block (this server serves a text-only model)",
               "document": "a document block (this server reads text blocks only)",
               "search_result": "a search_result block (send its text as a text block)",
               "server_tool_use": "a server tool's block (this server runs no server tools)",
               "web_search_tool_result": "a server tool's block (this server runs no server "
                                         "tools)"}


def _check_block_types(value: Any, allowed: tuple[str, ...]) -> None:
    """A clear error for a block of a kind this server cannot read, before pydantic's own."""
    if not isinstance(value, list):
        return
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in _UNREADABLE:
            raise ValueError(f"[{i}] is {_UNREADABLE[kind]}")
        if kind not in allowed:
            raise ValueError(f"[{i}] has type {kind!r}; expected one of "
                             f"{', '.join(allowed)}")


def _blocks_only(role: str, kinds: list[str]) -> dict[str, Any]:
    """JSON Schema: a message of this role whose content is blocks has only these kinds."""
    return {"if": {"required": ["role"], "properties": {"role": {"const": role}}},
            "then": {"properties": {"content": {"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"properties": {"type": {"enum": kinds}}}}]}}}}


# What Message._blocks_of_role checks, in the served schema too (the schema stays true).
_ROLE_RULES = [
    _blocks_only("user", ["text", "tool_result"]),
    _blocks_only("assistant", ["text", "thinking", "redacted_thinking", "tool_use"]),
    {"properties": {"content": {"anyOf": [{"type": "string"}, {
        "type": "array", "contains": {"required": ["type"], "properties": {
            "type": {"const": "tool_use"}}}, "minContains": 0,
        "maxContains": MAX_TOOL_CALLS}]}}},
]


class Message(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True,
                              json_schema_extra={"allOf": _ROLE_RULES})

    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1, max_length=MAX_BLOCKS)]

    @field_validator("content", mode="before")
    @classmethod
    def _readable_blocks(cls, value: Any) -> Any:
        _check_block_types(value, _BLOCK_TYPES)
        return value

    @model_validator(mode="after")
    def _blocks_of_role(self) -> Message:
        # NOTE: the error reads "messages[i] <this text>"
        if isinstance(self.content, str):
            return self
        kinds = {block.type for block in self.content}
        if self.role == "user" and kinds & {"thinking", "redacted_thinking", "tool_use"}:
            raise ValueError("is a user message with a thinking or tool_use block, which only "
                             "an assistant message may have")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("is an assistant message with a tool_result block, which only a "
                             "user message may have")
        if sum(block.type == "tool_use" for block in self.content) > MAX_TOOL_CALLS:
            raise ValueError(f"has more than {MAX_TOOL_CALLS} tool_use blocks")
        return self

    def blocks(self) -> list[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock
                               | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)

    @property
    def num_chars(self) -> int:
        """Characters of text this message renders (bounds its tokens)."""
        total = 0
        for block in self.blocks():
            if isinstance(block, TextBlock):
                total += len(block.text)
            elif isinstance(block, ThinkingBlock):
                total += len(block.thinking)
            elif isinstance(block, ToolUseBlock):
                total += len(block.name) + len(str(block.input))
            elif isinstance(block, ToolResultBlock):
                total += len(block.text)
        return total


class ToolDefinition(_Request):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    """A JSON schema of the tool's input object (shown to the model by the chat template)."""
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    """Accepted, as the chat route's function strict: a call forced by tool_choice any or tool
    is held to the schema by a grammar; under auto the input is not constrained."""

    @model_validator(mode="before")
    @classmethod
    def _no_server_tools(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"has type {kind!r}: a server tool, which this server does not "
                             "run (only client tools: name, description, input_schema)")
        return value


class AutoChoice(_Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class AnyChoice(_Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class NamedChoice(_Request):
    type: Literal["tool"]
    name: ToolName
    disable_parallel_tool_use: bool = False


class NoneChoice(_Request):
    type: Literal["none"]


ToolChoice = Annotated[AutoChoice | AnyChoice | NamedChoice | NoneChoice,
                       Field(discriminator="type")]


class ThinkingEnabled(_Request):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET, le=INT32_MAX)]
    """At least 1,024 and below max_tokens: the reasoning's end marker is forced once the
    reasoning has this many tokens (where the model's reasoning markers are one token each;
    else not enforced)."""


class ThinkingDisabled(_Request):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    """The JSON schema the reply's text is held to, token by token (the chat route's
    response_format json_schema)."""


class OutputConfig(_Request):
    format: OutputFormat | None = None


class Metadata(_Request):
    user_id: Annotated[str, Field(max_length=256)] | None = None


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1, examples=[
        [{"role": "user", "content": "Hi"}]])]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    """auto (the default with tools), any (at least one call), tool (a call of that tool) or
    none; any and tool hold the reply to a JSON grammar of calls."""
    thinking: Thinking | None = None
    """Sets the chat template's enable_thinking (and thinking) variable; unset: the model's
    default."""
    output_config: OutputConfig | None = None
    """format: the reply's text held to a JSON schema (beside tools only with tool_choice
    none). effort is not taken: thinking turns the reasoning on or off."""

    @model_validator(mode="after")
    def _consistent(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tools names the tool {twice[0]!r} twice")
        choice = self.tool_choice
        if isinstance(choice, AnyChoice | NamedChoice) and not names:
            raise ValueError("tool_choice forces a tool call, but tools offers no tool")
        if isinstance(choice, NamedChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which tools does "
                             "not offer")
        if self.output_format is not None and names and isinstance(choice, AutoChoice | None):
            raise ValueError("output_config.format with tools under tool_choice auto: a reply "
                             "held to a format cannot also call tools in the model's own "
                             "format; send tool_choice none, or no output_config.format")
        if self.output_format is not None and isinstance(choice, AnyChoice | NamedChoice):
            raise ValueError("output_config.format with a forced tool call (tool_choice any or "
                             "tool), which holds the reply to a grammar of calls: send one of "
                             "the two")
        return self

    @property
    def output_format(self) -> OutputFormat | None:
        return None if self.output_config is None else self.output_config.format

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n".join(block.text for block in self.system) or None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)]
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP)] | None = None
    """Each ends the reply (stop_reason "stop_sequence") and is not included in it."""
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) \
                and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


# ---- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TextOut(_Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(_Response):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""
    """Always "" (nothing to verify: send it back as it came)."""


class ToolUseOut(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(_Response):
    input_tokens: int
    """The prompt's tokens that were not read from the prefix cache."""
    output_tokens: int
    cache_read_input_tokens: int = 0
    """The prompt's tokens read from the prefix cache (the engine's automatic caching)."""
    cache_creation_input_tokens: int = 0


class MessageResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentOut]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(_Response):
    input_tokens: int


class MessageErrorInfo(_Response):
    type: str
    message: str


class MessageErrorResponse(_Response):
    """Every error of the Messages routes, and the `error` event of a failed stream."""

    type: Literal["error"] = "error"
    error: MessageErrorInfo
    request_id: str | None = None


class TextDelta(_Response):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(_Response):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(_Response):
    type: Literal["input_json_delta"]
    partial_json: str


class MessageStart(_Response):
    type: Literal["message_start"]
    message: MessageResponse


class ContentBlockStart(_Response):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentOut


class ContentBlockDelta(_Response):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStop(_Response):
    type: Literal["content_block_stop"]
    index: int


class MessageDeltaBody(_Response):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(_Response):
    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: MessageUsage


class MessageStop(_Response):
    type: Literal["message_stop"]


StreamEvent = Annotated[MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop
                        | MessageDelta | MessageStop | MessageErrorResponse,
                        Field(discriminator="type")]
