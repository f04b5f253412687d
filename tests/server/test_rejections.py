"""Bad input gets a 400 naming the field, and never reaches the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN
from tests.server.helpers import CHAT, COMPLETIONS, MESSAGES, engine_stats, post, rejected

# (extra fields, the param the error must name, a phrase the message must contain)
COMPLETION_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "greater than or equal to -2"),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "in [0, max_tokens=4]"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens",
     "cannot be combined with a structured output"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
    ({"allowed_token_ids": [1, 600]}, "allowed_token_ids", "outside the vocabulary"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"repetition_penalty": 101}, "repetition_penalty", "less than or equal to 100"),
    ({"repetition_penalty": "x"}, "repetition_penalty", "valid number"),
    ({"echo": 1}, "echo", "valid boolean"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "'abc' is not a token id"),
    ({"logit_bias": {"-5": 1.0}}, "logit_bias", "'-5' is not a token id"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "less than or equal to 100"),
    ({"logit_bias": {"5": "up"}}, "logit_bias", "valid number"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ({"logit_bias": {"600": 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"suffix": "x"}, "suffix", "unsupported field 'suffix'"),
    ({"functions": []}, "functions", "unsupported field 'functions'"),
    ({"n": 9}, "n", "less than or equal to 8"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": -0.1}, "top_p", "greater than or equal to 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": 1.5}, "max_tokens", "valid integer"),
    ({"max_tokens": "4"}, "max_tokens", "valid integer"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["a"] * 17}, "stop", "at most 16"),
    ({"stop": 5}, "stop", "non-empty string"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than or equal to 0"),
    ({"stop_token_ids": [600]}, "stop_token_ids", "outside the vocabulary"),
    ({"seed": "1"}, "seed", "valid integer"),
    ({"seed": 2**64}, "seed", "less than or equal to"),
    ({"ignore_eos": "yes"}, "ignore_eos", "valid boolean"),
    ({"user": 5}, "user", "valid string"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "unsupported field"),
    ({"prompt": 3.5}, "prompt", "must be a string"),
    ({"prompt": ["ok", [1]]}, "prompt", "must be a string"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 600]}, "prompt", "outside the vocabulary"),
    ({"prompt": [[1, 2], [3, 600]]}, "prompt", "prompt 1: "),
    ({"prompt": [1] * MAX_MODEL_LEN}, "prompt", "max_model_len"),
    ({"prompt": [1] * 100, "max_tokens": 29}, "max_tokens", "at most 28 tokens"),
    ({"prompt": ["a"] * 40, "n": 8}, "n", "the limit is 256"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
     "response_format", "refused with any other type"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not JSON"),
    ({"structured_outputs": {"grammar": "start: nothere"}}, "structured_outputs",
     "unknown name"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "True"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "unsupported field"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "give one of them"),
]

_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CHAT_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio",
     "unsupported field"),
    ({"messages": [{"role": "user"}]}, "messages[0]", "no content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "without tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]",
     "only a tool message"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [_CALL]}]}, "messages[0]",
     "only an assistant message"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {**_CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "messages", "max_model_len"),
    ({"top_logprobs": 3}, "top_logprobs", "requires logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"logprobs": 3}, "logprobs", "valid boolean"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({"tools": [_TOOL, {"type": "function", "function": {"name": "bad name"}}]},
     "tools[1].function.name", "pattern"),
    ({"tools": [_TOOL, _TOOL]}, "tools", "twice"),
    ({"tool_choice": "required"}, "tool_choice", "tools offers no function"),
    ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "does not offer"),
    ({"tools": [_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be given beside"),
    ({"tools": [_TOOL], "response_format": {"type": "json_object"}}, "tools",
     "cannot also call tools"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the server"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": "zero"}}}}, "response_format",
     "not valid"),
    ({"modalities": ["text"]}, "modalities", "unsupported field"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "differs"),
    ({"max_tokens": None, "max_completion_tokens": 500}, "max_completion_tokens",
     "max_model_len"),
    ({"presence_penalty": -3.0}, "presence_penalty", "greater than or equal to -2"),
    ({"n": 9}, "n", "less than or equal to 8"),
    ({"thinking_token_budget": -2}, "thinking_token_budget", "greater than or equal to -1"),
    # tiny-moe's byte tokenizer: no one-token reasoning marker to force
    ({"thinking_token_budget": 8}, "thinking_token_budget", "cannot be ended by one"),
]


def _check(http: httpx.Client, path: str, body: dict[str, Any], param: str, phrase: str) -> None:
    before = engine_stats(http)
    error = rejected(http, path, body)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param.split("[")[0] in error["message"] and phrase in error["message"], error
    after = engine_stats(http)
    assert after["num_refused"] == before["num_refused"]  # the engine never saw it
    assert after["num_steps"] == before["num_steps"]


@pytest.mark.parametrize("extra,param,phrase", COMPLETION_CASES,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(COMPLETION_CASES)])
def test_completion_rejects(http: httpx.Client, extra: dict[str, Any], param: str,
                            phrase: str) -> None:
    _check(http, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, **extra}, param, phrase)


@pytest.mark.parametrize("extra,param,phrase", CHAT_CASES,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(CHAT_CASES)])
def test_chat_rejects(http: httpx.Client, extra: dict[str, Any], param: str,
                      phrase: str) -> None:
    _check(http, CHAT, {"messages": MESSAGES, "max_tokens": 2, **extra}, param, phrase)


def test_passive_fields_at_their_neutral_value_are_accepted(http: httpx.Client) -> None:
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u1",
               "temperature": 0, "max_tokens": 2, "n": 1, "stream": False}
    assert post(http, COMPLETIONS, {"prompt": "Hi", "best_of": 1, "echo": False, **neutral})
    out = post(http, CHAT, {"messages": MESSAGES, "tools": [], "tool_choice": "none",
                            "response_format": {"type": "text"}, "thinking_token_budget": -1,
                            **neutral})
    assert out["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("field,literal", [("temperature", "NaN"), ("top_p", "Infinity"),
                                           ("min_p", "-Infinity")])
def test_non_finite_numbers_are_refused_by_name(http: httpx.Client, field: str,
                                                literal: str) -> None:
    """Python's json (and others) write NaN and Infinity, which the body's parser reads: a
    400 saying the number is not finite, not a range error about a value that has none."""
    body = f'{{"prompt": "Hi", "max_tokens": 2, "{field}": {literal}}}'.encode()
    before = engine_stats(http)
    r = http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "finite number" in error["message"], error
    assert engine_stats(http)["num_steps"] == before["num_steps"]


def test_unknown_model_is_404(http: httpx.Client) -> None:
    error = rejected(http, COMPLETIONS, {"model": "gpt-4", "prompt": "Hi"}, status=404)
    assert error["param"] == "model" and "tiny-moe" in error["message"]


def test_bad_json_and_routes(http: httpx.Client) -> None:
    r = http.post(COMPLETIONS, content=b'{"prompt": "a",', headers={"content-type": "x"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http.post(COMPLETIONS, content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = http.get(COMPLETIONS)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_rejections_carry_a_request_id(http: httpx.Client) -> None:
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "top_p": 2})
    assert r.status_code == 400 and r.headers["x-request-id"].startswith("cmpl-")
    r = http.post(CHAT, json={"messages": []})
    assert r.status_code == 400 and r.headers["x-request-id"].startswith("chatcmpl-")
