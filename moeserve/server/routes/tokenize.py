"""POST /tokenize and /detokenize (server/tokenize_protocol.py): the served tokenizer, no engine
request. A chat is rendered by the chat route's own `chat_prompt`, so its ids are those
/v1/chat/completions would submit for the same messages and tools."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from moeserve.server.errors import APIError
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.routes.chat import chat_prompt, check_template_kwargs
from moeserve.server.routes.request_limits import tokenize_off_loop_if_large
from moeserve.server.routes.serving import ServerContext, check_model, parse_body
from moeserve.server.tokenize_protocol import DetokenizeRequest, TokenizeRequest


async def tokenize(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, TokenizeRequest)
    check_model(ctx, req.model)
    tokenizer = ctx.client.tokenizer
    if req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False
        tokens = await tokenize_off_loop_if_large(
            len(text), lambda: tokenizer.encode(text, add_special_tokens=special))
    else:
        check_template_kwargs(req.chat_template_kwargs)
        chat = ChatCompletionRequest.model_construct(
            messages=req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs)
        _, tokens = await chat_prompt(ctx, chat, "", req.add_generation_prompt is not False,
                                      bool(req.add_special_tokens))
    strs = [ctx.token_string(t)[0] for t in tokens] if req.return_token_strs else None
    return Response(msgspec.json.encode({
        "count": len(tokens), "max_model_len": ctx.client.max_model_len, "tokens": tokens,
        "token_strs": strs}), media_type="application/json")


async def detokenize(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, DetokenizeRequest)
    check_model(ctx, req.model)
    vocab = ctx.client.model_config.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}]: the id {req.tokens[bad]} is outside the "
                       f"vocabulary [0, {vocab})", "tokens")
    tokens = req.tokens
    text = await tokenize_off_loop_if_large(
        len(tokens), lambda: ctx.client.tokenizer.decode(tokens, skip_special_tokens=False))
    return Response(msgspec.json.encode({"prompt": text}), media_type="application/json")
