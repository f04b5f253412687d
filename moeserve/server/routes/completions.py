"""POST /v1/completions: prompts (text or token ids, one or a list) -> text.

A list of prompts gives one choice per prompt (x n), indexed prompt-major like OpenAI. Each
streamed event carries one choice's `text` and `token_ids` of one engine step (the token ids
are a moeserve extension: a client can count tokens per event without a tokenizer).
`echo` begins each choice's text with its prompt's (its first streamed event carries it).
Logprobs use the legacy completions format: tokens, token_logprobs, top_logprobs (a dict per
token: token text -> logprob; where two tokens have the same text, e.g. two bytes that are not
UTF-8 on their own, the likelier one is kept) and text_offset.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from moeserve.server.protocol import CompletionRequest
from moeserve.server.routes.generation import Generation
from moeserve.server.routes.request_limits import check_prompt, tokenize_off_loop_if_large
from moeserve.server.routes.serving import (
    ChoiceResult,
    ServerContext,
    check_lengths,
    check_model,
    now,
    parse_body,
    sampling_params,
    serve,
)
from moeserve.server.structured_output import requested_output
from moeserve.types import Logprobs, RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def create_completion(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, CompletionRequest)
    check_model(ctx, req.model)
    check_prompt(req.prompt, req.n, ctx.client.max_model_len, ctx.max_prompt_chars)
    prompts = await tokenize_prompts(ctx, req.prompt)
    check_lengths(ctx, prompts, req.max_tokens, "max_tokens", "prompt")
    structured = requested_output(req.response_format, req.structured_outputs)
    params = sampling_params(req, prompts, req.max_tokens, DEFAULT_MAX_TOKENS, req.logprobs,
                             ctx.client.max_model_len, structured)
    choice_prompts = [p for p in prompts for _ in range(req.n)]
    gen = Generation(ctx.client, request_id, choice_prompts, params, "prompt")
    echoes = None
    if req.echo:  # each choice's prompt text, as sent (token ids decoded)
        texts = prompt_texts(ctx, req.prompt, prompts, req.skip_special_tokens)
        echoes = [t for t in texts for _ in range(req.n)]
    renderer = CompletionRenderer(ctx, request_id, req.logprobs is not None, echoes)
    return await serve(ctx, request, request_id, req, gen, renderer, prompts)


def prompt_texts(ctx: ServerContext, prompt: Any, prompts: list[list[int]],
                 skip_special_tokens: bool) -> list[str]:
    """The prompts' texts for echo: the strings as sent, token-id prompts decoded (special
    tokens left out as the request's skip_special_tokens says, as for its completion)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    decode = ctx.client.tokenizer.decode
    return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in prompts]


async def tokenize_prompts(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    """The prompt field as token-id lists, one per prompt; more than THREAD_TOKENIZE_CHARS of
    text in all is tokenized in one call off the event loop."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif not prompt or isinstance(prompt[0], int):
        return [prompt]
    elif isinstance(prompt[0], str):
        texts = prompt
    else:
        return prompt
    encode = ctx.client.tokenizer.encode

    def tokenize() -> list[list[int]]:
        return [encode(text) for text in texts]

    return await tokenize_off_loop_if_large(sum(len(text) for text in texts), tokenize)


class CompletionRenderer:
    def __init__(self, ctx: ServerContext, request_id: str, want_logprobs: bool,
                 echoes: list[str] | None = None) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.want_logprobs = want_logprobs
        self.echoes = echoes  # per choice: the prompt text its text begins with (echo)
        self.created = now()
        self._offsets: list[int] = []
        self._echoed: set[int] = set()  # streamed choices whose prompt text went out

    def envelope(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.served_model}

    def head(self, num_choices: int) -> bytes:
        self._offsets = [0] * num_choices
        return b""

    def chunk(self, index: int, out: RequestOutput, result: ChoiceResult) -> dict[str, Any]:
        text = out.text
        if self.echoes is not None and index not in self._echoed:  # a choice's first event
            self._echoed.add(index)
            text = self.echoes[index] + text
        choice: dict[str, Any] = {"index": index, "text": text,
                                  "token_ids": out.new_token_ids, "logprobs": None,
                                  "finish_reason": result.finish_reason}
        if self.want_logprobs:
            choice["logprobs"], self._offsets[index] = self.logprobs(
                out.new_token_ids, out.logprobs or [], self._offsets[index])
        if out.finished:
            choice["stop_reason"] = result.stop_reason
        return choice

    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            logprobs = self.logprobs(r.token_ids, r.logprobs, 0)[0] if self.want_logprobs else None
            text = "".join(r.text)
            if self.echoes is not None:
                text = self.echoes[i] + text
            choices.append({"index": i, "text": text, "token_ids": r.token_ids,
                            "logprobs": logprobs, "finish_reason": r.finish_reason,
                            "stop_reason": r.stop_reason})
        return {**self.envelope(), "choices": choices, "usage": usage}

    def logprobs(self, token_ids: list[int], logprobs: list[Logprobs],
                 offset: int) -> tuple[dict[str, Any], int]:
        """The legacy format for these tokens; text_offset continues from `offset`."""
        text = self.ctx.token_string
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs):
            token = text(token_id)[0]
            tokens.append(token)
            token_logprobs.append(lp.token_logprob)
            entry: dict[str, float] = {}
            for t, v in zip(lp.top_token_ids, lp.top_logprobs):
                entry.setdefault(text(t)[0], v)  # tokens with the same text: keep the likeliest
            top.append(entry)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}, offset
