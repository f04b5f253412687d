"""A Responses request (with its stored history) -> the chat completions request it is.

    instructions                      a "system" message first (a previous response's are not
                                      carried over, as in OpenAI's API)
    previous_response_id              that response's input and output items, before this input
    input (text)                      a "user" message
    message item                      a message of its role ("developer" stays "developer":
                                      the chat route shows it as "system")
    function_call items               the tool_calls of one assistant message (joined to the
                                      assistant message just before them, if any)
    function_call_output item         a "tool" message (tool_call_id = call_id)
    reasoning item                    the reasoning_content of the next assistant message
    tools, tool_choice,               the same fields of chat (function tools)
      parallel_tool_calls
    text.format                       response_format (json_schema flattened)
    reasoning.effort                  chat_template_kwargs {"enable_thinking", "thinking"}:
                                      false for "none", true for any other level
    max_output_tokens, temperature,   max_tokens, temperature, top_p, stream, user
      top_p, stream, user
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from moeserve.server.errors import APIError, from_validation_error
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    JsonSchemaTextFormat,
    MessageItem,
    NamedFunction,
    ReasoningItem,
    ResponsesRequest,
)
from moeserve.server.structured_output import ResponseFormat, requested_output


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """The request's input as items (a text input is one user message)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    return list(req.input)


def chat_request(req: ResponsesRequest, history: Sequence[InputItem]) -> ChatCompletionRequest:
    """The chat request of `history` (a previous response's items) + this request's input. The
    chat request's own validation runs too (an APIError 400 names its field)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += chat_messages([*history, *input_items(req)])
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "user": req.user,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, NamedFunction) else choice)
    if req.text is not None and req.text.format is not None:
        body["response_format"] = _response_format(req.text.format)
    if req.reasoning is not None and req.reasoning.effort is not None:
        on = req.reasoning.effort != "none"
        body["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _response_format(fmt: Any) -> dict[str, Any]:
    """text.format as chat's response_format, its grammar checked (a 400 naming text.format)."""
    if isinstance(fmt, JsonSchemaTextFormat):
        out = {"type": "json_schema", "json_schema": fmt.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    else:
        out = {"type": fmt.type}
    try:
        requested_output(ResponseFormat.model_validate(out), None)
    except APIError as e:
        raise APIError(400, e.message.replace("response_format", "text.format", 1),
                       "text.format") from None
    return out


def chat_messages(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Items -> chat messages (the module docstring's table)."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # waiting for the next assistant message
    previous: Any = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item)}}
            joins = isinstance(previous, FunctionCallItem) or (
                isinstance(previous, MessageItem) and previous.role == "assistant")
            if joins and not reasoning:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append(_assistant(None, reasoning, [call]))
        elif item.role == "assistant":
            out.append(_assistant(item.text, reasoning, []))
        else:
            out.append({"role": item.role, "content": item.text})
        previous = item
    return out


def _assistant(text: str | None, reasoning: list[str],
               calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    return message


def _arguments(item: FunctionCallItem) -> str:
    """The call's arguments, checked to be a JSON object (a 400 naming the call otherwise)."""
    try:
        ok = isinstance(json.loads(item.arguments), dict)
    except ValueError:
        ok = False
    if not ok:
        raise APIError(400, f"input: the function_call {item.call_id!r} has arguments that are "
                       "not a JSON object", "input")
    return item.arguments
