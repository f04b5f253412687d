"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one assistant reply.

    messages --apply_chat_template(add_generation_prompt=True)--> text
             --encode(add_special_tokens=False)--> prompt token ids

(the template already holds any BOS it wants). Text parts of a message are joined with "\\n".
Streaming: each choice first gets a delta {"role": "assistant", "content": ""}, then one delta
{"content": ...} per engine step, with `token_ids` beside it (moeserve extension). Without
max_tokens / max_completion_tokens a reply may run to max_model_len, as in OpenAI's API.
Logprobs use the chat format: {"content": [{token, logprob, bytes, top_logprobs}]}.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from moeserve.server.errors import APIError
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.routes.generation import Generation
from moeserve.server.routes.request_limits import check_messages, tokenize_off_loop_if_large
from moeserve.server.routes.serving import (
    ChoiceResult,
    ServerContext,
    check_lengths,
    check_model,
    now,
    parse_body,
    sampling_params,
    serve,
    sse,
)
from moeserve.types import Logprobs, RequestOutput


async def create_chat_completion(ctx: ServerContext, request: Request,
                                 request_id: str) -> Response:
    req = await parse_body(ctx, request, ChatCompletionRequest)
    check_model(ctx, req.model)
    check_messages([len(m.text) for m in req.messages], ctx.client.max_model_len,
                   ctx.max_prompt_chars)
    prompt = await chat_prompt(ctx, req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_lengths(ctx, [prompt], req.max_new_tokens, field, "messages")
    params = sampling_params(req, [prompt], req.max_new_tokens, None, req.num_logprobs,
                             ctx.client.max_model_len)
    gen = Generation(ctx.client, request_id, [prompt] * req.n, params, "messages")
    renderer = ChatRenderer(ctx, request_id, req.logprobs)
    return await serve(ctx, request, request_id, req, gen, renderer, [prompt])


async def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text} for m in req.messages]
    tokenizer = ctx.client.tokenizer

    def render() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception, or a template bug
            raise APIError(400, f"the chat template refused these messages: {e}",
                           "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    return await tokenize_off_loop_if_large(sum(len(m["content"]) for m in messages), render)


class ChatRenderer:
    def __init__(self, ctx: ServerContext, request_id: str, want_logprobs: bool) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.want_logprobs = want_logprobs
        self.created = now()

    def envelope(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.ctx.served_model}

    def head(self, num_choices: int) -> bytes:
        """The role delta of every choice, sent with the first content event."""
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
                    "logprobs": None, "finish_reason": None} for i in range(num_choices)]
        return b"".join(sse({**self.envelope(), "choices": [c]}) for c in choices)

    def chunk(self, index: int, out: RequestOutput, result: ChoiceResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": {"content": out.text},
                                  "token_ids": out.new_token_ids, "logprobs": None,
                                  "finish_reason": result.finish_reason}
        if self.want_logprobs:
            choice["logprobs"] = self.logprobs(out.new_token_ids, out.logprobs or [])
        if out.finished:
            choice["stop_reason"] = result.stop_reason
        return choice

    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(r.text)},
                    "token_ids": r.token_ids,
                    "logprobs": self.logprobs(r.token_ids, r.logprobs) if self.want_logprobs
                    else None,
                    "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
                   for i, r in enumerate(results)]
        return {**self.envelope(), "object": "chat.completion", "choices": choices,
                "usage": usage}

    def logprobs(self, token_ids: list[int], logprobs: list[Logprobs]) -> dict[str, Any]:
        text = self.ctx.token_string
        content = []
        for token_id, lp in zip(token_ids, logprobs):
            token, raw = text(token_id)
            top = []
            for t, v in zip(lp.top_token_ids, lp.top_logprobs):
                t_token, t_raw = text(t)
                top.append({"token": t_token, "logprob": v, "bytes": t_raw})
            content.append({"token": token, "logprob": lp.token_logprob, "bytes": raw,
                            "top_logprobs": top})
        return {"content": content, "refusal": None}
