"""The FastAPI app: routes, authentication, errors, and the engine's shutdown with the app.

    POST /v1/completions        routes/completions.py    (Bearer key when --api-key)
    POST /v1/chat/completions   routes/chat.py           (Bearer key when --api-key)
    POST /v1/messages           routes/messages.py: Anthropic's Messages API (the key as Bearer
                                or as Anthropic's x-api-key header; errors in its shape)
    POST /v1/messages/count_tokens   the same prompt's token count
    POST /v1/responses          routes/responses.py: OpenAI's Responses API (Bearer key)
    GET, DELETE /v1/responses/{response_id}   a stored response
    POST /v1/responses/{response_id}/cancel   end a background response
    GET /v1/responses/{response_id}/input_items   its input items, a page
    POST /tokenize, /detokenize routes/tokenize.py: the served tokenizer (vLLM's routes)
    GET  /v1/models             the served model          (Bearer key when --api-key)
    GET  /v1/engine             capacity report + live engine stats + server settings (key too)
    GET  /health                200 while this process and the engine process are alive (its
                                start-up included), else 503: a liveness probe
    GET  /ready                 200 only when the engine is ready and its loop answers, else 503
                                (while it starts: the /v1 routes answer 503 then too)
    GET  /metrics               Prometheus text (metrics.py)
    GET  /openapi.json, /docs   the OpenAPI document (openapi.py) and its Swagger UI (open)

Every /v1 response carries an X-Request-Id ("cmpl-...", "chatcmpl-..." for generation; a client's
own X-Request-Id header is used instead when it sends one, as in vLLM: 1-128 characters of
[A-Za-z0-9._:-], unique among the requests in flight, else 400). Every
error is OpenAI-style JSON (errors.py): a route raises APIError and `_guard` answers it; unknown
routes and methods too (a 405 keeps its Allow header). The app's lifespan ends by shutting the
engine client down, which ends in-flight requests with an error and stops the engine process.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from moeserve.gc_tuning import freeze_heap
from moeserve.server.agent.choice import choose_formats
from moeserve.server.errors import APIError
from moeserve.server.metrics import ServerMetrics
from moeserve.server.openapi import install as install_openapi
from moeserve.server.process.connections import BODY_TIMED_OUT
from moeserve.server.responses.store import ResponseStore
from moeserve.server.routes.chat import create_chat_completion
from moeserve.server.routes.completions import create_completion
from moeserve.server.routes.messages import count_tokens, create_message
from moeserve.server.routes.responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from moeserve.server.routes.serving import ServerContext, new_request_id, now
from moeserve.server.routes.tokenize import detokenize, tokenize

if TYPE_CHECKING:
    from moeserve.engine.process.async_client import AsyncEngineClient

logger = logging.getLogger("moeserve.server")
_REJECTED = {429: "queue_full", 503: "engine_unavailable"}
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
Handler = Callable[[ServerContext, Request, str], Awaitable[Response]]


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers,
                    media_type="application/json")


async def shutdown_engine(app: FastAPI) -> None:
    """Shut the engine client down once (the lifespan and the server's signal path both call
    this)."""
    ctx: ServerContext = app.state.ctx
    if not ctx.shut_down:
        ctx.shut_down = True
        await ctx.background.shutdown()
        await ctx.client.shutdown()


def build_app(client: AsyncEngineClient, api_key: str | None = None, *,
              settings: dict[str, Any] | None = None, tool_call_parser: str = "auto",
              reasoning_parser: str = "auto",
              responses: ResponseStore | None = None) -> FastAPI:
    """The HTTP app over a started engine client.

    Args:
        client: a started AsyncEngineClient; the app's shutdown shuts it down.
        api_key: when set, every /v1 route requires "Authorization: Bearer <api_key>".
        settings: the server's own settings, shown at /v1/engine (host, port, ...).
        tool_call_parser, reasoning_parser: the chat replies' formats (server/agent/choice.py:
            a name, "none" or "auto"); ValueError for an unknown name.
        responses: the Responses API's store (server/responses/store.py); default: a new
            one in memory.
    """
    names = {client.model_name, client.model}
    if client.sampling_defaults:
        logger.info("sampling defaults from the model's generation_config.json for the fields a "
                    "request leaves out: %s (--generation-config none keeps the neutral ones)",
                    client.sampling_defaults)
    agent = choose_formats(tool_call_parser, reasoning_parser, client.tokenizer,
                           client.model_config.architecture)
    ctx = ServerContext(client=client, metrics=ServerMetrics(client),
                        model_names=frozenset(names), api_key=api_key or None,
                        settings={**(settings or {}), **agent.describe(),
                                  "sampling_defaults": client.sampling_defaults}, agent=agent,
                        responses=ResponseStore() if responses is None else responses)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        freeze_heap()  # what start-up built lives as long as the process: keep GC off it
        yield
        await shutdown_engine(app)

    app = FastAPI(title="moeserve", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.ctx = ctx
    _add_routes(app, ctx)
    install_openapi(app, api_key=ctx.api_key is not None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})  # a 405's Allow
        return APIError(exc.status_code, str(exc.detail), headers=headers).to_response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        """The client went away before its body was read: nothing to answer, no traceback.
        (A body that timed out has had its 408, counted by the connection:
        process/connections.py.)"""
        if not request.scope.get(BODY_TIMED_OUT):
            ctx.metrics.disconnects.inc()
            logger.debug("%s %s: the client went away before its body was read",
                         request.method, request.url.path)
        return Response(status_code=499)

    return app


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    client = ctx.client

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _guard(ctx, request, "cmpl", create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _guard(ctx, request, "chatcmpl", create_chat_completion)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _guard(ctx, request, "msg", create_message, anthropic=True)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await _guard(ctx, request, None, count_tokens, anthropic=True)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _guard(ctx, request, "resp", create_response)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return await _guard(ctx, request, None, get_response)

    @app.delete("/v1/responses/{response_id}")
    async def deleted_response(request: Request, response_id: str) -> Response:
        return await _guard(ctx, request, None, delete_response)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancelled_response(request: Request, response_id: str) -> Response:
        return await _guard(ctx, request, None, cancel_response)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str) -> Response:
        return await _guard(ctx, request, None, list_input_items)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await _guard(ctx, request, None, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await _guard(ctx, request, None, detokenize)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _guard(ctx, request, None, _list_models)

    @app.get("/v1/engine")
    async def engine(request: Request) -> Response:
        return await _guard(ctx, request, None, _engine_state)

    @app.get("/health")
    async def health() -> Response:
        if client.alive:
            return _json({"status": "ok", "engine": "serving" if client.ready else "starting"})
        return _json({"status": "engine dead", "reason": "the engine process is not alive"}, 503)

    @app.get("/ready")
    async def ready() -> Response:
        if client.alive and await client.check_ready():
            return _json({"status": "ready"})
        reason = ("the engine process is not alive" if not client.alive else
                  "the engine is starting" if not client.ready else
                  "the engine loop did not answer")
        return _json({"status": "not ready", "reason": reason}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await _refresh_stats(client)
        return Response(ctx.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


async def _refresh_stats(client: AsyncEngineClient) -> None:
    """The client's stats arrive with each engine step; an idle engine sends none, so ask it
    (a ping's answer carries a fresh snapshot, taken after every message sent before it)."""
    if client.alive:
        await client.check_ready(timeout=0.5)


async def _guard(ctx: ServerContext, request: Request, id_prefix: str | None,
                 handler: Handler, anthropic: bool = False) -> Response:
    """Authentication, then the handler; an APIError becomes its JSON response (`anthropic`:
    in the Messages API's shape)."""
    request_id = new_request_id(id_prefix) if id_prefix else ""
    try:
        if id_prefix:
            request_id = _client_request_id(request) or request_id
        _check_api_key(ctx, request)
        if not ctx.client.ready:
            raise APIError(503, "the engine is starting (loading weights, tuning, capturing "
                           "graphs): retry when /ready answers 200", headers={"Retry-After": "5"})
        return await handler(ctx, request, request_id)
    except APIError as e:
        if id_prefix:
            ctx.metrics.rejected.labels(_REJECTED.get(e.status, "invalid_request")).inc()
        level = logging.DEBUG if e.status == 429 else logging.INFO
        logger.log(level, "%s %s %s: %d %s", request_id or "-", request.method,
                   request.url.path, e.status, e.message)
        return e.to_response(request_id, anthropic)


def _client_request_id(request: Request) -> str | None:
    """The client's X-Request-Id header, when it sent a valid one; 400 when it is not."""
    value = request.headers.get("x-request-id")
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise APIError(400, "the X-Request-Id header must be 1-128 characters of "
                       "[A-Za-z0-9._:-]", "X-Request-Id")
    return value


def _check_api_key(ctx: ServerContext, request: Request) -> None:
    """The key as "Authorization: Bearer <key>" (OpenAI's clients) or "x-api-key: <key>"
    (Anthropic's), on every keyed route."""
    if ctx.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), ctx.api_key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                       "(or 'x-api-key: <key>')", headers={"WWW-Authenticate": "Bearer"})


async def _list_models(ctx: ServerContext, request: Request, request_id: str) -> Response:
    card = {"id": ctx.served_model, "object": "model", "created": now(), "owned_by": "moeserve",
            "max_model_len": ctx.client.max_model_len}
    return _json({"object": "list", "data": [card]})


async def _engine_state(ctx: ServerContext, request: Request, request_id: str) -> Response:
    client = ctx.client
    await _refresh_stats(client)
    server = {**ctx.settings, "served_model_name": ctx.served_model,
              "api_key": ctx.api_key is not None, "max_model_len": client.max_model_len,
              "max_running_requests": client.max_running_requests,
              "max_waiting_requests": getattr(client, "max_waiting_requests", None),
              "num_in_flight": client.num_in_flight, "engine_alive": client.alive,
              "engine_pid": client.engine_pid, "pid": os.getpid()}
    return _json({"capacity_report": client.capacity_report,
                  "stats": msgspec.structs.asdict(client.stats), "server": server})
