"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items:
OpenAI's Responses API over the chat route.

    body --ResponsesRequest (server/responses/protocol.py)--> + the stored history of
         previous_response_id --chat_request (responses/convert.py)--> chat request
         --prepare_chat (routes/chat.py: the template, tools, reasoning, grammars)--> one
         engine request
    reply --ResponseRenderer (responses/events.py)--> the response object, or its events;
          with store (the default) kept in ServerContext.responses (responses/store.py: one
          store for all the server's API processes)
    input_items: the items a stored response took as input (the history it continued and its
          own input), a page of `limit` (1-100, 20) in `order` (desc, asc) after the item
          `after`, as OpenAI's list object

Errors answer in the OpenAI shape, as the other OpenAI routes.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from moeserve.server.errors import APIError
from moeserve.server.responses.convert import chat_request, input_items
from moeserve.server.responses.events import ResponseRenderer
from moeserve.server.responses.protocol import ResponsesRequest
from moeserve.server.responses.store import MAX_RESPONSES
from moeserve.server.routes.chat import prepare_chat
from moeserve.server.routes.generation import Generation
from moeserve.server.routes.request_limits import check_messages
from moeserve.server.routes.serving import ServerContext, check_model, parse_body, serve


async def create_response(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, ResponsesRequest)
    check_model(ctx, req.model)
    history = _history(ctx, req.previous_response_id)
    chat = chat_request(req, history)
    chars = [m.num_chars for m in chat.messages]
    check_messages(chars, ctx.client.max_model_len, ctx.max_prompt_chars)
    prepared = await prepare_chat(ctx, chat, "max_output_tokens", None)
    gen = Generation(ctx.client, request_id, [prepared.prompt], prepared.params, "input")
    new_items = input_items(req)
    conversation = [*history, *new_items]

    def on_done(body: dict[str, Any]) -> None:
        if req.store:
            ctx.responses.add(body, conversation)

    tokenizer = ctx.client.tokenizer
    renderer = ResponseRenderer(
        request_id, prepared.prompt, _echo(ctx, req), prepared.new_parser,
        lambda text: len(tokenizer.encode(text, add_special_tokens=False)), on_done)
    return await serve(ctx, request, request_id, chat, gen, renderer, [prepared.prompt],
                       events=renderer.stream)


def _history(ctx: ServerContext, previous_id: str | None) -> list[Any]:
    if previous_id is None:
        return []
    stored = ctx.responses.get(previous_id)
    if stored is None:
        raise APIError(404, f"previous_response_id: no stored response {previous_id!r} "
                       f"({_KEPT})", "previous_response_id")
    return stored.items


def _echo(ctx: ServerContext, req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings, as the response object repeats them."""
    text = req.text.model_dump(exclude_none=True, by_alias=True) if req.text else {}
    choice = req.tool_choice or "auto"
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": ctx.served_model, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "user": req.user, "metadata": req.metadata or {}}


async def get_response(ctx: ServerContext, request: Request, request_id: str) -> Response:
    stored = ctx.responses.get(_response_id(request))
    if stored is None:
        raise _not_stored(request)
    return Response(msgspec.json.encode(stored.body), media_type="application/json")


async def delete_response(ctx: ServerContext, request: Request, request_id: str) -> Response:
    response_id = _response_id(request)
    if not ctx.responses.delete(response_id):
        raise _not_stored(request)
    return Response(msgspec.json.encode({"id": response_id, "object": "response",
                                         "deleted": True}), media_type="application/json")


def _response_id(request: Request) -> str:
    return str(request.path_params["response_id"])


async def list_input_items(ctx: ServerContext, request: Request, request_id: str) -> Response:
    query = request.query_params
    unknown = sorted(set(query) - {"limit", "order", "after"})
    if unknown:
        raise APIError(400, f"unsupported query parameter {unknown[0]!r} (limit, order and "
                       "after are taken)", unknown[0])
    limit = _limit(query.get("limit", "20"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
    stored = ctx.responses.get(_response_id(request))
    if stored is None:
        raise _not_stored(request)
    items = [item.model_dump(mode="json", exclude_none=True, by_alias=True)
             for item in stored.items[:stored.num_input]]
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise APIError(404, f"after: the response has no input item {after!r}", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return Response(msgspec.json.encode({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}),
        media_type="application/json")


def _limit(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got "
                       f"{text!r}", "limit")
    return int(text)


MAX_LIST_LIMIT = 100
_KEPT = (f"responses sent with store true are kept, the {MAX_RESPONSES} most recently used "
         "within the store's bytes, in one store for all the server's API processes")


def _not_stored(request: Request) -> APIError:
    return APIError(404, f"no stored response {_response_id(request)!r} ({_KEPT})",
                    "response_id")
