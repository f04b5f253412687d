"""Structured outputs through the live server (tiny-moe: random weights, so only the grammar
makes the replies valid): response_format and structured_outputs on both routes, forced tool
calls, streamed replies that join up to the whole one, the request shapes validated against
the served schema."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema_rs
import pytest

from moeserve.server.protocol import ChatCompletionResponse, CompletionRequest
from tests.server.helpers import CHAT, COMPLETIONS, MESSAGES, engine_stats, post, stream

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"enum": ["Paris", "Oslo"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA,
                                                      "strict": True}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}}}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["tz"],
    "properties": {"tz": {"enum": ["CET", "UTC"]}}}}}


def _valid(text: str) -> None:
    jsonschema_rs.validate(SCHEMA, json.loads(text))


@pytest.mark.parametrize("fields, check", [
    ({"response_format": JSON_SCHEMA}, _valid),
    ({"structured_outputs": {"json": SCHEMA}}, _valid),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, _valid),
    ({"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}},
     lambda t: re.fullmatch("[a-c]{3}-[0-9]", t) or 1 / 0),
    ({"structured_outputs": {"choice": ["left", "right"]}},
     lambda t: t in ("left", "right") or 1 / 0),
    ({"structured_outputs": {"grammar": 'start: "x" | "y" start'}},
     lambda t: re.fullmatch("y*x", t) or 1 / 0),
])
def test_completions_follow_the_format(http: httpx.Client, fields: dict[str, Any],
                                       check: Any) -> None:
    CompletionRequest.model_validate({"prompt": "Hi", **fields})  # the shape the schema serves
    out = post(http, COMPLETIONS, {"prompt": ["Hi", "Plan a trip"], "max_tokens": 60, "n": 2,
                                   "seed": 3, **fields})
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop", choice
        check(choice["text"])
    assert engine_stats(http)["num_structured"] == 0  # the grammars went with their requests
    assert "moeserve_engine_grammar_wait_steps_total" in http.get("/metrics").text


def test_a_chat_reply_follows_json_schema_and_streams_the_same(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "response_format": JSON_SCHEMA, "seed": 5, "max_tokens": 60}
    whole = ChatCompletionResponse.model_validate(post(http, CHAT, body))
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and text is not None
    _valid(text)
    events = stream(http, CHAT, body)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"]) == text


def test_json_object_mode(http: httpx.Client) -> None:
    out = post(http, CHAT, {"messages": MESSAGES, "response_format": {"type": "json_object"},
                            "max_tokens": 8, "seed": 1})
    choice = out["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_named_tool_choice_returns_a_call_of_it(long_http: httpx.Client) -> None:
    http = long_http
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "seed": 2, "max_tokens": 40,
            "tool_choice": {"type": "function", "function": {"name": "time"}}}
    out = ChatCompletionResponse.model_validate(post(http, CHAT, body)).model_dump()
    choice = out["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "time" and choice["message"]["content"] is None
    assert json.loads(call["function"]["arguments"])["tz"] in ("CET", "UTC")
    assert choice["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a named function
    events = stream(http, CHAT, body)
    streamed = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []
                if e["choices"]]
    assert [(c["index"], c["function"]) for c in streamed] == [(0, call["function"])]


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_returns_calls(long_http: httpx.Client, parallel: bool) -> None:
    http = long_http
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": parallel, "max_tokens": 100, "n": 3, "seed": 7}
    out = post(http, CHAT, body)
    assert any(c["finish_reason"] == "tool_calls" for c in out["choices"])
    for choice in out["choices"]:
        if choice["finish_reason"] == "length":  # cut: given back as content, nothing lost
            assert choice["message"]["content"].startswith("[")
            continue
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and calls
        assert len(calls) == 1 or parallel
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            tool = {"weather": WEATHER, "time": TIME}[call["function"]["name"]]
            jsonschema_rs.validate(tool["function"]["parameters"], arguments)


def test_a_bad_schema_is_a_400_and_the_server_goes_on(http: httpx.Client) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert post(http, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})["choices"]


def test_a_grammar_past_a_parser_limit_is_a_400_for_that_request(http: httpx.Client) -> None:
    """It breaks only while generating (its first token): the request's own grammar is at
    fault, so a 400 naming it, and the server goes on."""
    grammar = "start: " + " | ".join(['"0"'] * 2001)
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 4,
                                     "structured_outputs": {"grammar": grammar}})
    assert r.status_code == 400, r.text
    assert "the grammar cannot go on" in r.json()["error"]["message"]
    assert post(http, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})["choices"]
