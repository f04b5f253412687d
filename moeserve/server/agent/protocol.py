"""The chat's messages and the agent API's wire shapes: tools offered, tool_choice, the messages
of a request's history (with their tool calls, tool answers and reasoning), and the tool calls
of a reply (whole and as streamed deltas).

Parsed as strictly as the rest of the protocol (server/protocol.py imports these): unknown
fields are errors, every list and string is bounded. A function's name follows OpenAI's rule
(letters, digits, "_", "-", at most 64) with "." allowed too, for namespaced tools.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOOLS = 256
MAX_TOOL_CALLS = 128  # in one assistant message of the history
MAX_ID_LEN = 256

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
CallId = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; the chat template shows it to the model, and
    formats that write arguments as text (GLM's) read each one's "type" from it."""
    strict: bool | None = None
    """tool_choice "auto": a call of this function holds its arguments to `parameters` where the
    tool-call format takes it (agent/strict_calls.py: hermes); forced calls always do."""


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Request):
    name: FunctionName
    arguments: str
    """A JSON object, as text (OpenAI's shape); the template gets it decoded."""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            decoded = json.loads(value)
        except ValueError:
            raise ValueError("must be a JSON object as a string, got text that is not "
                             "JSON") from None
        if not isinstance(decoded, dict):
            raise ValueError(f"must be a JSON object as a string, got a JSON "
                             f"{type(decoded).__name__}")
        return value


class MessageToolCall(_Request):
    id: CallId
    type: Literal["function"]
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: arguments decoded into a mapping (Qwen's,
        GLM's and DeepSeek's templates iterate or dump them), as transformers' docs give."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name,
                             "arguments": json.loads(self.function.arguments)}}


def _a(role: str) -> str:
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"


ToolCalls = Annotated[list[MessageToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)]


class TextPart(_Request):
    type: Literal["text"]
    text: str


def _only_in(field: str, json_type: str, role: str) -> dict[str, Any]:
    """JSON Schema: a message with `field` set (not null) has this role."""
    return {"if": {"required": [field], "properties": {field: {"type": json_type}}},
            "then": {"properties": {"role": {"const": role}}}}


# What _fields_of_role checks, in the served schema too (the schema stays true: test_openapi).
_ROLE_RULES = [
    _only_in("tool_calls", "array", "assistant"),
    _only_in("reasoning_content", "string", "assistant"),
    _only_in("tool_call_id", "string", "tool"),
    {"if": {"properties": {"role": {"const": "tool"}}},
     "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
    {"if": {"not": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}},
     "then": {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                         "tool_calls": {"type": "array"}}}},
]


class ChatMessage(_Request):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True,
                              json_schema_extra={"allOf": _ROLE_RULES})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    """"developer" is OpenAI's newer name for "system" (the template gets "system")."""
    content: str | list[TextPart] | None = None
    """Required except in an assistant message with tool_calls."""
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: ToolCalls | None = None
    """An assistant message's calls (its function arguments are JSON objects as text)."""
    tool_call_id: CallId | None = None
    """A tool message's answer to this call id (required there, and only there)."""
    reasoning_content: str | None = None
    """An assistant message's reasoning, for templates that show earlier reasoning (GLM's)."""

    @field_validator("content", mode="wrap")
    @classmethod
    def _text_parts_only(cls, value: Any, handler: Any) -> str | list[TextPart] | None:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"must contain only text parts ({{\"type\": \"text\", "
                                     f"\"text\": ...}}), got a part of type {kind!r}")
        try:
            return handler(value)
        except ValueError:
            raise ValueError("must be a string or a list of text parts "
                             "({\"type\": \"text\", \"text\": ...})") from None

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        # NOTE: the error reads "messages[i] <this text>"
        for field, role in (("tool_calls", "assistant"), ("reasoning_content", "assistant"),
                            ("tool_call_id", "tool")):
            if getattr(self, field) is not None and self.role != role:
                raise ValueError(f"has {field}, which only {_a(role)} message may have")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("is a tool message without tool_call_id (the id of the call it "
                             "answers)")
        if self.content is None and self.tool_calls is None:
            raise ValueError("has no content (only an assistant message with tool_calls may "
                             "have none)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    @property
    def num_chars(self) -> int:
        """Characters of text the template renders from this message (bounds its tokens)."""
        calls = sum(len(c.function.name) + len(c.function.arguments)
                    for c in self.tool_calls or ())
        return len(self.text) + len(self.reasoning_content or "") + calls

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' conventions)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
            if self.content is None:
                out["content"] = None
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# ---- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ReplyFunction(_Response):
    name: str
    arguments: str
    """The arguments object as JSON text."""


class ReplyToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ReplyFunction


class ToolCallDelta(_Response):
    """A streamed call: moeserve sends each call whole, in one delta (id, name and all the
    arguments), once the model has written all of it."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: ReplyFunction
