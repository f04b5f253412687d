"""The app's OpenAPI document (GET /openapi.json, shown at GET /docs): docs/openai-compat.md's
contract in machine-readable form.

The routes parse their own bodies (serving.parse_body: strict pydantic, a 400 naming the field)
and build their own responses, so FastAPI sees neither a body parameter nor a response model and
would document every route as "200, any JSON". This module declares what each route does:

    FastAPI's document (paths, operation ids)
      + per operation (_OPERATIONS): summary, requestBody (the pydantic request model), the
        responses (exactly the statuses the route can answer, each with its media type, schema
        and headers), and, with --api-key, 401 and the bearer security requirement
      + components.schemas: pydantic's JSON schemas of protocol.py's models, with refs
        "#/components/schemas/{model}" (models_json_schema), and msgspec's of EngineStats

Every limit of a single field is in its type (protocol.py), so the request schemas are true
field by field; what a schema cannot say (limits across fields, or of the served model:
vocabulary, max_model_len, prompts x n) is a 400, which every POST route documents. One
difference is JSON Schema's own: 1.0 is an "integer" there, while the server refuses it.

The statuses, from the code: _guard answers APIError (400 parse_body / check_lengths / the
engine's validation, 401 _check_api_key, 404 check_model, 413 parse_body, 429 / 503 / 500
engine_error); 408 is the connection layer's body deadline on any POST; /ready answers 503
when the engine is not ready, /health when its process is dead. Not documented: 404 / 405 for
routes and methods that do not exist (not operations), and the 499 a route returns when its
client has gone away (no one receives it).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from moeserve.engine.process.protocol import EngineStats
from moeserve.server.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageErrorResponse,
    MessageResponse,
    MessagesRequest,
)
from moeserve.server.anthropic.protocol import StreamEvent as MessageEvent
from moeserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    EngineState,
    ErrorResponse,
    ModelList,
    StatusResponse,
)
from moeserve.server.responses.protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from moeserve.server.responses.protocol import StreamEvent as ResponseEvent
from moeserve.server.routes.serving import MAX_BODY_BYTES
from moeserve.server.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

REF = "#/components/schemas/{model}"
MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, CompletionResponse, CompletionStreamResponse,
    ChatCompletionResponse, ChatCompletionStreamResponse, ModelList, EngineState,
    StatusResponse, ErrorResponse, MessagesRequest, CountTokensRequest, MessageResponse,
    CountTokensResponse, MessageErrorResponse, ResponsesRequest, ResponseObject,
    DeletedResponse, InputItemList, TokenizeRequest, TokenizeResponse, DetokenizeRequest,
    DetokenizeResponse)

_ERRORS = {
    400: "A bad or unsupported field (`param` names it), a body that is not a JSON object, or a "
         "limit the schema cannot show: stream_options without stream, top_logprobs without "
         "logprobs, seed + n - 1 beyond int64, prompts x n over 256, a token id outside the "
         "vocabulary, a prompt or prompt + max_tokens beyond max_model_len.",
    401: "A missing or wrong API key (the server runs with --api-key).",
    404: "`model` names a model this server does not serve; or (the Responses API) "
         "previous_response_id or the path names no stored response.",
    408: "The body did not arrive in time.",
    413: f"The body is larger than {MAX_BODY_BYTES} bytes.",
    429: "The server is full: more requests in flight than max running requests + "
         "--max-waiting-requests. Retry after the Retry-After seconds.",
    500: "An internal fault of this request (logged with its traceback).",
    503: "The engine is still starting (Retry-After), its process is dead, the server is "
         "shutting down, or the connection is over --max-connections (answered at accept, "
         "Retry-After): answered at once.",
}
_ROUTE_STATUSES = frozenset({200, 400, 401, 404, 413, 429, 500})  # always carry X-Request-Id
_REQUEST_ID = {"description": "The request's id (cmpl-... / chatcmpl-...), as in the body's "
                              "`id` and the server's log lines.", "schema": {"type": "string"}}
_BEARER = "bearerAuth"
_X_API_KEY = "apiKeyAuth"  # Anthropic's header, accepted on every keyed route
# the named-event streams' events (unions: no model names of their own)
_EVENT_UNIONS = {"MessageStreamEvent": MessageEvent, "ResponseStreamEvent": ResponseEvent}


@dataclass(frozen=True, slots=True)
class _Operation:
    summary: str
    ok: dict[str, Any]  # the 200 response object
    errors: tuple[int, ...] = ()  # the other statuses (401 is added with --api-key)
    request: type[BaseModel] | None = None  # the JSON body
    keyed: bool = False  # behind --api-key
    request_id: bool = False  # X-Request-Id on its responses
    anthropic: bool = False  # errors in the Messages API's shape
    query: tuple[dict[str, Any], ...] = ()  # its query parameters (the route parses them)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _json(description: str, model: type[BaseModel]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _generation(what: str, whole: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """The 200 of a generation route: JSON, or with stream: true an event stream whose schema
    (OpenAPI 3.1: one event, as an object of its fields) gives each event's data: a chunk, the
    error of an engine failure mid-stream, or the closing [DONE]."""
    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string",
        "anyOf": [{"const": "[DONE]"},
                  {"contentMediaType": "application/json",
                   "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}}}
    return {"description": f"The {what}: one JSON object, or with `stream: true` server-sent "
                           f"events: `data: <{chunk.__name__}>` per engine step per choice, the "
                           "usage chunk (stream_options.include_usage), then `data: [DONE]`; "
                           "an engine failure mid-stream sends `data: <ErrorResponse>` before "
                           "[DONE].",
            "content": {"application/json": {"schema": _ref(whole)},
                        "text/event-stream": {"schema": event}}}


def _named_events(description: str, whole: type[BaseModel], events: str) -> dict[str, Any]:
    """The 200 of a route whose stream names its events (the Messages and Responses APIs):
    one JSON object, or with stream: true events, each `event: <type>` and `data: <the event
    as JSON>`, the events' schema the union `events` (_EVENT_UNIONS)."""
    event = {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"$ref": REF.format(model=events)}}}}
    return {"description": description,
            "content": {"application/json": {"schema": _ref(whole)},
                        "text/event-stream": {"schema": event}}}


_POST_ERRORS = (400, 404, 408, 413, 429, 500, 503)
_GET_ERRORS = (503,)  # a connection over the cap, at accept; the /v1 routes while starting
_OPERATIONS: dict[tuple[str, str], _Operation] = {
    ("/v1/completions", "post"): _Operation(
        "Text completion", _generation("completion", CompletionResponse,
                                       CompletionStreamResponse),
        _POST_ERRORS, CompletionRequest, keyed=True, request_id=True),
    ("/v1/chat/completions", "post"): _Operation(
        "Chat completion (the tokenizer's chat template)",
        _generation("chat completion", ChatCompletionResponse, ChatCompletionStreamResponse),
        _POST_ERRORS, ChatCompletionRequest, keyed=True, request_id=True),
    ("/v1/messages", "post"): _Operation(
        "Anthropic's Messages API (the tokenizer's chat template)", _named_events(
            "The message: one JSON object, or with `stream: true` server-sent events: "
            "message_start, per content block content_block_start, its deltas and "
            "content_block_stop, then message_delta and message_stop; an engine failure "
            "mid-stream sends an `error` event and ends the stream.", MessageResponse,
            "MessageStreamEvent"),
        _POST_ERRORS, MessagesRequest, keyed=True, request_id=True, anthropic=True),
    ("/v1/messages/count_tokens", "post"): _Operation(
        "The prompt's tokens, as POST /v1/messages would render it",
        _json("The count: {\"input_tokens\": N}.", CountTokensResponse),
        (400, 404, 408, 413, 503), CountTokensRequest, keyed=True, anthropic=True),
    ("/v1/responses", "post"): _Operation(
        "OpenAI's Responses API (the tokenizer's chat template)", _named_events(
            "The response: one JSON object (with `background: true` at once, \"queued\"), or "
            "with `stream: true` (with or without background) server-sent events: "
            "response.created, response.in_progress, per output item its added / delta / done "
            "events, then response.completed (response.incomplete when max_output_tokens cut "
            "it); an engine failure mid-stream sends an `error` event and ends the stream.",
            ResponseObject, "ResponseStreamEvent"),
        _POST_ERRORS, ResponsesRequest, keyed=True, request_id=True),
    ("/v1/responses/{response_id}", "get"): _Operation(
        "A stored response", _named_events(
            "The response, as it was sent (a background one as it is now); with "
            "`stream=true`, a streamed background response's events past `starting_after`, "
            "then the ones to come until it ends.", ResponseObject, "ResponseStreamEvent"),
        (400, 404, 503), keyed=True, query=(
            {"name": "stream", "in": "query", "required": False,
             "schema": {"type": "boolean", "default": False}},
            {"name": "starting_after", "in": "query", "required": False,
             "description": "An event's sequence_number: the stream resumes after it.",
             "schema": {"type": "integer", "minimum": -1}},
            {"name": "include", "in": "query", "required": False,
             "description": "Accepted (nothing is encrypted).", "schema": {"type": "string"}})),
    ("/v1/responses/{response_id}/cancel", "post"): _Operation(
        "End a queued or in-progress background response", _json(
            "The response, cancelled.", ResponseObject), (400, 404, 503), keyed=True),
    ("/v1/responses/{response_id}", "delete"): _Operation(
        "Delete a stored response", _json("Deleted.", DeletedResponse), (404, 503),
        keyed=True),
    ("/v1/responses/{response_id}/input_items", "get"): _Operation(
        "A stored response's input items", _json(
            "A page of the items the response took as input (the history it continued and its "
            "own input).", InputItemList), (400, 404, 503), keyed=True, query=(
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
                {"name": "order", "in": "query", "required": False,
                 "schema": {"enum": ["asc", "desc"], "default": "desc"}},
                {"name": "after", "in": "query", "required": False,
                 "description": "An item id: the page starts after it.",
                 "schema": {"type": "string"}})),
    ("/tokenize", "post"): _Operation(
        "A prompt's or a chat's token ids (vLLM's route; a chat rendered as chat renders it)",
        _json("The ids.", TokenizeResponse), (400, 404, 408, 413, 503), TokenizeRequest,
        keyed=True),
    ("/detokenize", "post"): _Operation(
        "Token ids' text (vLLM's route)", _json("The text.", DetokenizeResponse),
        (400, 404, 408, 413, 503), DetokenizeRequest, keyed=True),
    ("/v1/models", "get"): _Operation(
        "The served model", _json("The served model, with max_model_len.", ModelList),
        _GET_ERRORS, keyed=True),
    ("/v1/engine", "get"): _Operation(
        "Capacity report, live engine stats and this server's settings",
        _json("The engine's state.", EngineState), _GET_ERRORS, keyed=True),
    ("/health", "get"): _Operation(
        "Liveness", _json("The API process and the engine process are alive, the engine's "
                          "start-up included: {\"status\": \"ok\", \"engine\": \"starting\" "
                          "| \"serving\"}.", StatusResponse), _GET_ERRORS),
    ("/ready", "get"): _Operation(
        "Readiness", _json("The engine is ready and its loop answers: "
                           "{\"status\": \"ready\"}.", StatusResponse), _GET_ERRORS),
    ("/metrics", "get"): _Operation(
        "Prometheus metrics", {"description": "Prometheus text format 0.0.4.",
                               "content": {"text/plain": {"schema": {"type": "string"}}}},
        _GET_ERRORS),
}
_NOT_READY = {  # their own 503 body, or the connection cap's error at accept
    "/health": "The engine process is dead: {\"status\": ..., \"reason\": ...}; or the "
               "connection is over --max-connections (an ErrorResponse, at accept).",
    "/ready": "The engine is not ready (starting, dead, or its loop did not answer): "
              "{\"status\": \"not ready\", \"reason\": ...}; or the connection is over "
              "--max-connections (an ErrorResponse, at accept).",
}


def install(app: FastAPI, api_key: bool) -> None:
    """Serve build_openapi's document as the app's (built on first use, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, api_key)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI, api_key: bool) -> dict[str, Any]:
    """FastAPI's document of the app's routes with every operation declared from _OPERATIONS.

    Raises KeyError naming a route that _OPERATIONS does not describe."""
    doc = get_openapi(title=app.title, version=_version(), routes=app.routes,
                      description="moeserve's OpenAI-compatible API. docs/openai-compat.md is "
                                  "the contract in prose; this is its machine-readable form.")
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            spec = _OPERATIONS[(path, method)]
            declared = [*operation.get("parameters", ()), *spec.query]
            params = {"parameters": declared} if declared else {}
            methods[method] = {"operationId": operation["operationId"], **params,
                               **_operation(path, spec, api_key)}
    components = doc.setdefault("components", {})
    components["schemas"] = component_schemas()
    if api_key:
        components["securitySchemes"] = {
            _BEARER: {"type": "http", "scheme": "bearer"},
            _X_API_KEY: {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return doc


def _version() -> str:
    try:
        return importlib.metadata.version("moeserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0+unknown"


def _operation(path: str, spec: _Operation, api_key: bool) -> dict[str, Any]:
    keyed = spec.keyed and api_key
    statuses = sorted((*spec.errors, 401) if keyed else spec.errors)
    responses = {"200": _with_headers(spec.ok, 200, spec.request_id)}
    for status in statuses:
        if path in _NOT_READY and status == 503:
            response = {"description": _NOT_READY[path], "content": {"application/json": {
                "schema": {"anyOf": [_ref(StatusResponse), _ref(ErrorResponse)]}}}}
        else:
            response = _json(_ERRORS[status],
                             MessageErrorResponse if spec.anthropic else ErrorResponse)
        responses[str(status)] = _with_headers(response, status, spec.request_id)
    out: dict[str, Any] = {"summary": spec.summary, "responses": responses}
    if spec.request is not None:
        out["requestBody"] = {"required": True,
                              "content": {"application/json": {"schema": _ref(spec.request)}}}
    if keyed:
        out["security"] = [{_BEARER: []}, {_X_API_KEY: []}]  # either one
    return out


def _with_headers(response: dict[str, Any], status: int, request_id: bool) -> dict[str, Any]:
    headers: dict[str, Any] = {}
    if request_id and status != 408:  # a 408 comes from the connection layer, before the route
        headers["X-Request-Id"] = {**_REQUEST_ID, "required": status in _ROUTE_STATUSES}
    if status in (429, 503):  # 503: while the engine starts, and at accept
        headers["Retry-After"] = {"description": "Seconds to wait before retrying.",
                                  "required": status == 429,
                                  "schema": {"type": "integer", "minimum": 0}}
    if status == 401:
        headers["WWW-Authenticate"] = {"required": True, "schema": {"type": "string"}}
    return {**response, "headers": headers} if headers else response


def component_schemas() -> dict[str, Any]:
    """JSON schemas of MODELS and what they use, by name, refs pointing into the same dict;
    EngineState's `stats` is EngineStats (a msgspec struct: msgspec writes its schema)."""
    _, top = models_json_schema([(m, "validation") for m in MODELS], ref_template=REF)
    schemas = top["$defs"]
    (ref,), structs = msgspec.json.schema_components(
        [EngineStats], ref_template=REF.replace("{model}", "{name}"))
    stats = structs["EngineStats"]
    # /v1/engine sends msgspec.structs.asdict(stats): every field, and only those
    stats.update(required=list(stats["properties"]), additionalProperties=False)
    schemas.update(structs)
    for name, union in _EVENT_UNIONS.items():
        events = TypeAdapter(union).json_schema(ref_template=REF)
        schemas.update(events.pop("$defs"))
        schemas[name] = events
    state = schemas["EngineState"]["properties"]
    state["stats"] = {**ref, "description": state["stats"].get("description", "")}
    return schemas
