"""The OpenAPI document: every route declared with exactly its statuses, refs that resolve, and
request schemas true to the validators, field by field. The live run against a real server is
tests/faults/test_schema_fuzz.py."""

from __future__ import annotations

import json
import types
from typing import Any

import httpx
import jsonschema_rs
import pytest
from pydantic import BaseModel, ValidationError

from moeserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from moeserve.server.app import build_app
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.server.responses.protocol import ResponsesRequest
from moeserve.tokenizer import ByteTokenizer
from tests.server.conftest import API_KEY, LiveServer

POST = {"200", "400", "404", "408", "413", "429", "500", "503"}
STATUSES = {  # what each route can answer, without --api-key
    ("/v1/completions", "post"): POST,
    ("/v1/chat/completions", "post"): POST,
    ("/v1/messages", "post"): POST,
    ("/v1/messages/count_tokens", "post"): {"200", "400", "404", "408", "413", "503"},
    ("/v1/responses", "post"): POST,
    ("/v1/responses/{response_id}", "get"): {"200", "400", "404", "503"},  # 400: ?stream
    ("/v1/responses/{response_id}/cancel", "post"): {"200", "400", "404", "503"},
    ("/v1/responses/{response_id}", "delete"): {"200", "404", "503"},
    ("/v1/responses/{response_id}/input_items", "get"): {"200", "400", "404", "503"},
    ("/tokenize", "post"): {"200", "400", "404", "408", "413", "503"},
    ("/detokenize", "post"): {"200", "400", "404", "408", "413", "503"},
    ("/v1/models", "get"): {"200", "503"},  # 503: while the engine starts, and at accept
    ("/v1/engine", "get"): {"200", "503"},
    ("/health", "get"): {"200", "503"},
    ("/ready", "get"): {"200", "503"},
    ("/metrics", "get"): {"200", "503"},  # 503: a connection over the cap, at accept
}


def _doc(api_key: str | None = None) -> dict[str, Any]:
    client = types.SimpleNamespace(model_name="tiny-moe", model="tiny-moe", capacity_report={},
                                   tokenizer=ByteTokenizer(512, None, None),
                                   model_config=types.SimpleNamespace(architecture="Test"),
                                   sampling_defaults={})
    return build_app(client, api_key).openapi()  # type: ignore[arg-type]


def _operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(path, method): op for path, methods in doc["paths"].items()
            for method, op in methods.items()}


def test_every_route_with_exactly_its_statuses() -> None:
    ops = _operations(_doc())
    assert {key: set(op["responses"]) for key, op in ops.items()} == STATUSES
    assert "securitySchemes" not in _doc()["components"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
        op = ops[(path, "post")]
        assert op["requestBody"]["required"] is True
        ok = op["responses"]["200"]
        assert set(ok["content"]) == {"application/json", "text/event-stream"}
        assert ok["headers"]["X-Request-Id"]["required"] is True
        assert op["responses"]["429"]["headers"]["Retry-After"]["required"] is True
        for status, response in op["responses"].items():
            assert set(response["content"]) != set() and response["description"], status
    assert set(ops[("/metrics", "get")]["responses"]["200"]["content"]) == {"text/plain"}


def test_api_key_adds_401_and_the_bearer_scheme() -> None:
    doc = _doc(API_KEY)
    assert doc["components"]["securitySchemes"] == {
        "bearerAuth": {"type": "http", "scheme": "bearer"},
        "apiKeyAuth": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    for (path, method), op in _operations(doc).items():
        keyed = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        expected = STATUSES[(path, method)] | ({"401"} if keyed else set())
        assert set(op["responses"]) == expected, path
        assert ("security" in op) == keyed, path
        if keyed:
            assert op["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True


def test_every_ref_resolves() -> None:
    doc = _doc(API_KEY)
    schemas = doc["components"]["schemas"]
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert refs
    prefix = "#/components/schemas/"
    assert all(ref.startswith(prefix) and ref[len(prefix):] in schemas for ref in refs), refs
    for model in ("CompletionStreamResponse", "ChatCompletionStreamResponse", "EngineStats",
                  "MessageStreamEvent", "MessageErrorResponse", "ResponseStreamEvent"):
        assert f"{prefix}{model}" in refs


def test_the_messages_routes_document_anthropic_errors() -> None:
    ops = _operations(_doc())
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for status, response in ops[(path, "post")]["responses"].items():
            if status != "200":
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/MessageErrorResponse"}, status


# Values tried in every field: each type, bounds and just past them, neutral values.
PROBES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 8, 9, 20, 21, -2, 0.0, -0.0, 1.0, 2.0, 0.5, 1.5, 2.5, -0.1,
    5e-324, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, "", "a", "3", "none",
    "auto", "x" * 256, "x" * 257, [], [""], ["a"], ["a"] * 16, ["a"] * 17, ["x" * 257], [1],
    [-1], [1.5], [1.0], [[1]], [[]], [True], ["a", [1]], {}, {"a": 1.0}, {"a": "b"},
    {"type": "text"}, {"type": "json_object"}, {"type": "text", "x": 1}, {"include_usage": True},
    {"include_usage": 1}, [{"type": "function"}], [{"role": "user", "content": "x"}],
    [{"role": "tool", "content": "x"}], [{"role": "user", "content": [{"type": "text",
                                                                       "text": "t"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    [{"role": "user", "content": "x", "name": "n"}], [{"role": "user"}],
    # the Messages API's shapes
    [{"role": "user", "content": [{"type": "image", "source": {}}]}],
    [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
    [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}],
    [{"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}]},
     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "r",
                                   "is_error": True}]}],
    [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                        "input": {}}] * 129}],
    [{"role": "user", "content": [{"type": "text", "text": "t",
                                   "cache_control": {"type": "ephemeral"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": "t", "citations": [1]}]}],
    [{"type": "text", "text": "s"}], [{"name": "f", "input_schema": {}}],
    [{"name": "f", "input_schema": {}, "type": "web_search_20250305"}],
    {"type": "any"}, {"type": "tool", "name": "f"}, {"type": "auto",
                                                     "disable_parallel_tool_use": True},
    {"type": "enabled", "budget_tokens": 1024}, {"type": "enabled", "budget_tokens": 1023},
    {"type": "disabled"}, {"user_id": "u"},
    # the Responses API's shapes
    [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
    [{"type": "function_call_output", "call_id": "c", "output": "r"}],
    [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]}],
    [{"type": "web_search_call", "id": "w"}], [{"type": "function", "name": "f"}],
    [{"type": "web_search"}], {"type": "function", "name": "f"},
    {"format": {"type": "json_object"}}, {"effort": "none"}, {"effort": "max"},
    ["reasoning.encrypted_content"], "disabled",
]
# Bases that pass every limit across fields, so a probe of one field meets only its own.
BASES: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (CompletionRequest, {"prompt": "a", "stream": True}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stream": True,
                             "logprobs": True}),
    (MessagesRequest, {"model": "m", "max_tokens": 4096, "messages": [
        {"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}]}),
    (CountTokensRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"name": "f", "input_schema": {}}]}),
    (ResponsesRequest, {"input": "x", "tools": [{"type": "function", "name": "f"}]}),
]


def _integral_float(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, list):
        return any(_integral_float(v) for v in value)
    if isinstance(value, dict):
        return any(_integral_float(v) for v in value.values())
    return False


@pytest.mark.parametrize("model,base", BASES, ids=[m.__name__ for m, _ in BASES])
def test_request_schema_is_true_field_by_field(model: type[BaseModel],
                                               base: dict[str, Any]) -> None:
    """For every field and probe: valid under the served schema <=> accepted by the model. The
    one difference is JSON Schema's: an integral float (1.0) is an "integer" there, refused
    here."""
    doc = _doc()
    root = {"$ref": f"#/components/schemas/{model.__name__}", "components": doc["components"]}
    validator = jsonschema_rs.Draft202012Validator(root)
    mismatches = []
    for field in model.model_fields:
        for probe in PROBES:
            body = {**base, field: probe}
            if field == "stream" and probe is not True:
                body.pop("stream_options", None)
            by_schema = validator.is_valid(body)
            try:
                model.model_validate_json(json.dumps(body))
                by_model = True
            except ValidationError:
                by_model = False
            if by_schema != by_model and not (by_schema and _integral_float(probe)):
                mismatches.append((field, probe, by_schema, by_model))
    assert not mismatches


def test_openapi_and_docs_are_open(live: LiveServer) -> None:
    with httpx.Client(base_url=live.keyed_url, timeout=30) as keyed:
        doc = keyed.get("/openapi.json")
        assert doc.status_code == 200
        assert "401" in doc.json()["paths"]["/v1/completions"]["post"]["responses"]
        docs = keyed.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()
        assert keyed.get("/v1/models").status_code == 401  # the routes themselves stay keyed
    with httpx.Client(base_url=live.url, timeout=30) as plain:
        doc = plain.get("/openapi.json").json()
        assert "401" not in doc["paths"]["/v1/completions"]["post"]["responses"]
