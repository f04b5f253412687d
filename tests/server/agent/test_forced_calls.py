"""Forced tool calls (tool_choice "required" or named): the JSON grammar of calls, the reply read
back as calls, and the format's start after the reasoning when the reply starts inside it."""

from __future__ import annotations

import json
import types
from typing import Any

import jsonschema_rs
import pytest

from moeserve.server.agent.choice import choose_formats
from moeserve.server.agent.forced_calls import ForcedCallSplitter, forced_output
from moeserve.server.agent.protocol import NamedToolChoice, Tool
from moeserve.server.errors import APIError
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.routes.chat import chat_output
from moeserve.tokenizer import ByteTokenizer

PARAMS = {"type": "object", "required": ["tz"], "properties": {"tz": {"type": "string"}}}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
         for n, p in (("time", PARAMS), ("ping", None))]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "time"}})


def _schema(choice: Any, parallel: bool = True) -> dict[str, Any]:
    return json.loads(forced_output(TOOLS, choice, parallel).spec)


def test_a_named_choice_holds_the_reply_to_the_functions_parameters() -> None:
    assert _schema(NAMED) == PARAMS
    ping = NamedToolChoice.model_validate({"type": "function", "function": {"name": "ping"}})
    assert _schema(ping) == {"type": "object"}  # no parameters: any object


@pytest.mark.parametrize("parallel", [True, False])
def test_required_holds_the_reply_to_a_list_of_offered_calls(parallel: bool) -> None:
    schema = _schema("required", parallel)
    valid = [{"name": "time", "parameters": {"tz": "CET"}}, {"name": "ping", "parameters": {}}]
    assert jsonschema_rs.is_valid(schema, valid[:1])
    assert jsonschema_rs.is_valid(schema, valid) == parallel
    for bad in ([], [{"name": "time", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "ping", "parameters": {}, "extra": 1}]):
        assert not jsonschema_rs.is_valid(schema, bad), bad


@pytest.mark.parametrize("choice, text, content, calls", [
    (NAMED, '{"tz": "CET"}', "", [("time", {"tz": "CET"})]),
    (NAMED, '{"tz": "CE', '{"tz": "CE', []),  # cut by max_tokens: given back as content
    ("required", '[{"name": "ping", "parameters": {}}, {"name": "time", "parameters": '
                 '{"tz": "UTC"}}]', "", [("ping", {}), ("time", {"tz": "UTC"})]),
    ("required", "[]", "[]", []),
    ("required", '[{"name": "ping"}]', '[{"name": "ping"}]', []),
])
def test_the_reply_is_read_back_as_calls(choice: Any, text: str, content: str,
                                         calls: list[tuple[str, dict]]) -> None:
    splitter = ForcedCallSplitter(choice)
    held = [splitter.feed(text[i:i + 3]) for i in range(0, len(text), 3)]
    assert all(part == ("", []) for part in held)  # nothing released before the end
    rest, parsed = splitter.finish()
    assert rest == content and [(c.name, c.arguments) for c in parsed] == calls
    assert splitter.num_calls == len(calls)


class _ThinkTokenizer(ByteTokenizer):
    """Bytes, plus "</think>" as one special token (as in Qwen3's, DeepSeek-R1's, GLM's)."""

    chat_template = "{{ '<think>' }}"  # the reasoning parser's auto choice reads the markers

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [300] if text == "</think>" else super().encode(text)


@pytest.mark.parametrize("tokenizer, start_after", [(_ThinkTokenizer(512, None, None), 300),
                                                    (ByteTokenizer(512, None, None), None)])
def test_inside_the_reasoning_the_format_starts_after_its_end(tokenizer: ByteTokenizer,
                                                              start_after: int | None) -> None:
    agent = choose_formats("hermes", "deepseek_r1", tokenizer, "Test")
    ctx = types.SimpleNamespace(agent=agent, client=types.SimpleNamespace(tokenizer=tokenizer))
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "t?"}],
        "response_format": {"type": "json_object"}})
    assert chat_output(ctx, req, "<|assistant|>\n").start_after is None  # type: ignore[arg-type]
    if start_after is None:  # "</think>" is 8 byte tokens: the format could not start after it
        with pytest.raises(APIError, match="8 tokens"):
            chat_output(ctx, req, "<|assistant|>\n<think>\n")  # type: ignore[arg-type]
        return
    structured = chat_output(ctx, req, "<|assistant|>\n<think>\n")  # type: ignore[arg-type]
    assert structured.start_after == start_after and structured.kind == "json_object"
