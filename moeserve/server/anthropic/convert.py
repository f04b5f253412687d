"""A Messages request -> the chat completions request it is, and a reply's parts -> content
blocks. What each Anthropic piece becomes:

    system (text or text blocks)     a "system" message (the blocks' text joined by "\\n")
    user text blocks                  a "user" message of text parts
    user tool_result blocks           one "tool" message each (tool_call_id = tool_use_id),
                                      before the message's text; is_error leads with "Error: "
    assistant text / thinking /       one "assistant" message: content, reasoning_content (the
      tool_use blocks                 thinking joined), tool_calls (input as JSON text)
    a final assistant message         the prefill: its text is appended after the template's
                                      generation prompt, and the reply continues it
    tools [{name, description,        tools [{"type": "function", "function": {name,
      input_schema, strict}]          description, parameters, strict}}]
    tool_choice auto / any / tool /   "auto" / "required" / a named function / "none";
      none                            disable_parallel_tool_use -> parallel_tool_calls false
    thinking enabled / disabled       chat_template_kwargs {"enable_thinking": bool,
                                      "thinking": bool} (Qwen's and GLM's templates read the
                                      first, DeepSeek-V3.1's the second); budget_tokens ->
                                      thinking_token_budget (enforced where it can be)
    output_config.format              response_format {"type": "json_schema", "json_schema":
      (json_schema)                   {"name": "output", "schema"}}
    stop_sequences, temperature,      stop, temperature, top_p, top_k, max_tokens, user
      top_p, top_k, max_tokens,
      metadata.user_id
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from moeserve.server.anthropic.protocol import (
    AnyChoice,
    AutoChoice,
    CountTokensRequest,
    Message,
    MessagesRequest,
    NamedChoice,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
)
from moeserve.server.errors import APIError, from_validation_error
from moeserve.server.protocol import ChatCompletionRequest


def chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, str]:
    """The chat request, and the prefill the reply continues ("" when none). The chat
    request's own validation runs too (an APIError 400 names its field when it refuses)."""
    messages, prefill = list(req.messages), ""
    if messages[-1].role == "assistant":
        blocks = messages.pop().blocks()
        if any(not isinstance(b, TextBlock) for b in blocks):
            raise APIError(400, "messages: the last message is an assistant message (a prefill "
                           "the reply continues), which may have only text blocks", "messages")
        prefill = "".join(b.text for b in blocks)
    chat: list[dict[str, Any]] = []
    if req.system_text is not None:
        chat.append({"role": "system", "content": req.system_text})
    for message in messages:
        chat += _user(message) if message.role == "user" else [_assistant(message)]
    if not chat:  # only a prefill: the template still needs a turn to answer
        chat.append({"role": "user", "content": ""})
    body: dict[str, Any] = {"model": req.model, "messages": chat}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {}),
            **({"strict": t.strict} if t.strict is not None else {})}}
            for t in req.tools]
    _tool_choice(req, body)
    if req.output_format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_format.schema_}}
    if req.thinking is not None:
        enabled = isinstance(req.thinking, ThinkingEnabled)
        body["chat_template_kwargs"] = {"enable_thinking": enabled, "thinking": enabled}
        if isinstance(req.thinking, ThinkingEnabled):
            body["thinking_token_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences or None,
                    user=req.metadata.user_id if req.metadata else None)
    try:
        return ChatCompletionRequest.model_validate(body), prefill
    except ValidationError as e:
        raise from_validation_error(e) from None


def _tool_choice(req: CountTokensRequest, body: dict[str, Any]) -> None:
    choice = req.tool_choice
    if choice is None or not req.tools:
        return
    if isinstance(choice, AutoChoice | AnyChoice | NamedChoice):
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(choice, NamedChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _user(message: Message) -> list[dict[str, Any]]:
    """A user message's tool results (each a tool message), then its text."""
    blocks = message.blocks()
    out: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
        for b in blocks if isinstance(b, ToolResultBlock)]
    texts = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
    if texts or not out:
        out.append({"role": "user", "content": texts or ""})
    return out


def _assistant(message: Message) -> dict[str, Any]:
    blocks = message.blocks()
    texts = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    out: dict[str, Any] = {"role": "assistant", "content": texts or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = reasoning
    return out
