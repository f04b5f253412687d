"""The OpenAI wire protocol's response models (server/protocol.py re-exports them): they
document the shapes and build non-streamed responses; the streaming path writes the same shapes
as plain dicts (for speed), and the tests validate every streamed chunk against the chunk
models here."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from moeserve.server.agent.protocol import ReplyToolCall, ToolCallDelta

__all__ = [
    "AssistantMessage",
    "ChatChoice",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "ChatLogprobs",
    "ChatStreamChoice",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionResponse",
    "CompletionStreamResponse",
    "Delta",
    "EngineState",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "PromptTokensDetails",
    "ServerInfo",
    "StatusResponse",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]  # null: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    logprob: float
    decoded_token: str


class CompletionChoice(_Response):
    index: int
    text: str
    token_ids: list[int]  # moeserve extension: the tokens of `text`
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # vLLM's, with the prompt_logprobs field: per prompt token (null for the first), by id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(_Response):
    """One SSE event of a streamed completion; the usage chunk has empty choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob]
    refusal: None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """null when the reply is tool calls alone."""
    reasoning_content: str | None = None
    """The reasoning, when the server separates it (--reasoning-parser)."""
    tool_calls: list[ReplyToolCall] | None = None


ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    token_ids: list[int]  # moeserve extension
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: Delta
    token_ids: list[int]  # moeserve extension: the tokens of this delta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeserve"
    max_model_len: int  # moeserve extension


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


class StatusResponse(_Response):
    """GET /health and GET /ready: {"status": "ok", "engine": ...}, {"status": "ready"}, or why
    not."""

    status: str
    engine: Literal["starting", "serving"] | None = None  # /health 200: the engine's phase
    reason: str | None = None


class ServerInfo(_Response):
    """The `server` part of GET /v1/engine: the launcher's settings (host, port, http, loop,
    api_servers, engine_args, ...: whatever `moeserve serve` passed), then these."""

    model_config = ConfigDict(extra="allow")

    served_model_name: str
    api_key: bool  # whether --api-key is set (never the key)
    max_model_len: int
    max_running_requests: int
    max_waiting_requests: int | None
    num_in_flight: int
    engine_alive: bool
    engine_pid: int
    pid: int  # this API process


class EngineState(_Response):
    """GET /v1/engine."""

    capacity_report: dict[str, Any]
    """What the engine chose at start-up and why (runner/capacity.py)."""
    stats: dict[str, Any]
    """The engine's latest snapshot (engine/process/protocol.py EngineStats)."""
    server: ServerInfo
