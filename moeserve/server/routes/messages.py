"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat route.

    body --MessagesRequest (server/anthropic/protocol.py)--> chat request + prefill
         (anthropic/convert.py) --prepare_chat (routes/chat.py: the chat template, tools,
         reasoning, grammars of forced calls)--> one engine request
    reply --MessageRenderer (anthropic/events.py)--> a message of content blocks, or its events

Errors answer in Anthropic's shape ({"type": "error", "error": {"type", "message"}}) with the
same statuses as the OpenAI routes. count_tokens renders the prompt as /v1/messages would and
counts its tokens (no engine request). thinking's budget_tokens is the engine's reasoning
budget where the reasoning's markers are one token each (chat's thinking_token_budget,
prepare_chat's budget_optional).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from moeserve.server.anthropic.convert import chat_request
from moeserve.server.anthropic.events import MessageRenderer
from moeserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.routes.chat import chat_prompt, check_agent_fields, prepare_chat
from moeserve.server.routes.generation import Generation
from moeserve.server.routes.request_limits import check_messages
from moeserve.server.routes.serving import ServerContext, check_model, parse_body, serve


async def create_message(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, MessagesRequest)
    chat, prefill = _chat(ctx, req)
    # the thinking budget (the chat request's thinking_token_budget): enforced where it can be
    prepared = await prepare_chat(ctx, chat, "max_tokens", None, prefill, budget_optional=True)
    gen = Generation(ctx.client, request_id, [prepared.prompt], prepared.params, "messages")
    renderer = MessageRenderer(ctx.served_model, request_id, prepared.prompt,
                               prepared.new_parser, tuple(req.stop_sequences or ()))
    return await serve(ctx, request, request_id, chat, gen, renderer, [prepared.prompt],
                       events=renderer.stream)


async def count_tokens(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, CountTokensRequest)
    chat, prefill = _chat(ctx, req)
    check_agent_fields(ctx, chat)
    _, prompt = await chat_prompt(ctx, chat, prefill)
    return Response(msgspec.json.encode({"input_tokens": len(prompt)}),
                    media_type="application/json")


def _chat(ctx: ServerContext, req: CountTokensRequest) -> tuple[ChatCompletionRequest, str]:
    check_model(ctx, req.model)
    chars = [m.num_chars for m in req.messages] + [len(req.system_text or "")]
    check_messages(chars, ctx.client.max_model_len, ctx.max_prompt_chars)
    return chat_request(req)
