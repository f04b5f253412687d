"""Units without an engine: request models, error JSON, sampling params, usage, the rate meter,
and the serve flags."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from moeserve.engine.process.async_client import EngineDeadError, QueueFullError
from moeserve.server.errors import APIError, from_validation_error
from moeserve.server.metrics import RateMeter
from moeserve.server.process.launch import add_serve_args
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.server.routes.generation import engine_error
from moeserve.server.routes.serving import ChoiceResult, sampling_params, usage_dict


def _error(model: type, body: str) -> APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(body)
    return from_validation_error(info.value)


def test_prompt_shapes() -> None:
    for prompt in ['"text"', "[1, 2]", '["a", "b"]', "[[1], [2, 3]]"]:
        CompletionRequest.model_validate_json(f'{{"prompt": {prompt}}}')
    assert _error(CompletionRequest, '{"prompt": [1.5]}').param == "prompt"
    assert _error(CompletionRequest, '{"prompt": [true]}').param == "prompt"


def test_error_json_names_the_field() -> None:
    e = _error(CompletionRequest, '{"prompt": "a", "best_of": 2}')
    assert e.to_dict() == {"error": {
        "message": "best_of is not supported (only 1 or null is accepted)",
        "type": "invalid_request_error", "param": "best_of", "code": 400}}
    e = _error(ChatCompletionRequest, '{"messages": [{"role": "user", "content": "x", "y": 1}]}')
    assert (e.message, e.param) == ("unsupported field 'messages[0].y'", "messages[0].y")
    e = _error(CompletionRequest, '{"prompt": "a", "stream_options": {"include_usage": true}}')
    assert e.param == "stream_options" and "stream is true" in e.message
    e = _error(CompletionRequest, "{}")
    assert (e.message, e.param) == ("prompt is required", "prompt")


def test_strict_types() -> None:
    """No silent coercion: "1" is not 1, 1.0 is not an int, 1 is not true."""
    for body, param in [('{"prompt": "a", "max_tokens": "3"}', "max_tokens"),
                        ('{"prompt": "a", "n": 2.0}', "n"),
                        ('{"prompt": "a", "stream": 1}', "stream")]:
        assert _error(CompletionRequest, body).param == param
    req = CompletionRequest.model_validate_json('{"prompt": "a", "temperature": 1}')
    assert req.temperature == 1.0  # an int is a valid number


def test_engine_errors_map_to_status() -> None:
    full = engine_error(QueueFullError("full"), "prompt")
    assert full.status == 429 and full.headers == {"Retry-After": "1"}
    assert engine_error(EngineDeadError("gone"), "prompt").status == 503
    bad = engine_error(ValueError("stop token id 900 is outside the vocabulary"), "prompt")
    assert (bad.status, bad.param) == (400, "stop_token_ids")
    assert bad.message.startswith("stop_token_ids: ")
    assert engine_error(RuntimeError("boom"), None).status == 500


def test_sampling_params_per_choice() -> None:
    req = CompletionRequest(prompt=[[1, 2], [3, 4, 5]], n=3, seed=10, temperature=0.5,
                            stop="x", logprobs=2)
    params = sampling_params(req, [[1, 2], [3, 4, 5]], None, 16, req.logprobs, 18)
    assert [p.seed for p in params] == [10, 11, 12] * 2
    assert [p.max_tokens for p in params] == [16] * 3 + [15] * 3  # capped by the context
    assert all(p.stop == ("x",) and p.logprobs == 2 and p.temperature == 0.5 for p in params)
    unseeded = sampling_params(CompletionRequest(prompt="a", n=2), [[1]], 4, None, None, 20)
    assert [p.seed for p in unseeded] == [None, None]
    assert [p.temperature for p in unseeded] == [1.0, 1.0]  # OpenAI's default
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert chat.num_logprobs == 0 and chat.max_new_tokens is None
    assert sampling_params(chat, [[1] * 5], None, None, 0, 20)[0].max_tokens == 15


def test_usage_counts_each_prompt_once() -> None:
    results = [ChoiceResult(num_tokens=n, num_cached_tokens=c)
               for n, c in [(3, 16), (4, 16), (5, 0), (6, 0)]]
    usage = usage_dict([[1] * 20, [2] * 7], results, n=2)
    assert usage == {"prompt_tokens": 27, "completion_tokens": 18, "total_tokens": 45,
                     "prompt_tokens_details": {"cached_tokens": 16}}


def test_rate_meter() -> None:
    meter = RateMeter(window=5)
    for second in range(100, 110):
        meter.add(10 * second, now=second + 0.5)
    meter.add(7, now=109.9)
    # the five complete seconds before 110: 105..109 (the current second is not complete)
    assert meter.rate(now=110.2) == sum(10 * s for s in range(105, 110)) / 5 + 7 / 5
    assert meter.rate(now=200.0) == 0.0


def test_serve_args() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--preset", "tiny-moe", "--max-running-requests", "64"])
    assert args.model == "tiny-moe" and args.max_running_requests == 64
    assert (args.host, args.port, args.max_waiting_requests) == ("127.0.0.1", 8000, 4096)
    assert parser.parse_args(["--model", "/ckpt"]).model == "/ckpt"
    assert parser.parse_args([]).api_key is None
