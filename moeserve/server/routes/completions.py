"""POST /v1/completions: prompts (text or token ids, one or a list) -> text.

A list of prompts gives one choice per prompt (x n), indexed prompt-major like OpenAI. Each
streamed event carries one choice's `text` and `token_ids` of one engine step (the token ids
are a moeserve extension: a client can count tokens per event without a tokenizer).
`echo` begins each choice's text with its prompt's (its first streamed event carries it).
Logprobs use the legacy completions format: tokens, token_logprobs, top_logprobs (a dict per
token: token text -> logprob; where two tokens have the same text, e.g. two bytes that are not
UTF-8 on their own, the likelier one is kept) and text_offset; with echo they begin with the
prompt's tokens, the first one's logprob and top logprobs null (what lm-evaluation-harness
reads for a loglikelihood). `prompt_logprobs` (vLLM's) gives each choice a list of them by
token id instead: null for the first prompt token, then {id: {"logprob", "decoded_token"}}
holding the prompt token and its top n. Both come from the engine's prompt logprobs
(sched/prompt_logprobs.py), with the choice's first output.
"""

from __future__ import annotations

import dataclasses
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
    truncate_prompts,
)
from moeserve.server.structured_output import requested_output
from moeserve.types import Logprobs, RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def create_completion(ctx: ServerContext, request: Request, request_id: str) -> Response:
    req = await parse_body(ctx, request, CompletionRequest)
    check_model(ctx, req.model)
    check_prompt(req.prompt, req.n, ctx.client.max_model_len, ctx.max_prompt_chars,
                 req.truncate_prompt_tokens is not None)
    sent = await tokenize_prompts(ctx, req.prompt)
    prompts = truncate_prompts(req, sent, ctx.client.max_model_len)
    check_lengths(ctx, prompts, req.max_tokens, "max_tokens", "prompt")
    structured = requested_output(req.response_format, req.structured_outputs)
    params = sampling_params(req, prompts, req.max_tokens, DEFAULT_MAX_TOKENS, req.logprobs,
                             ctx.client.max_model_len, structured, ctx.sampling_defaults)
    if req.num_prompt_logprobs is not None:
        params = [dataclasses.replace(p, prompt_logprobs=req.num_prompt_logprobs) for p in params]
    choice_prompts = [p for p in prompts for _ in range(req.n)]
    gen = Generation(ctx.client, request_id, choice_prompts, params, "prompt")
    echoes = None
    if req.echo:  # each choice's prompt text, as sent (token ids decoded)
        texts = prompt_texts(ctx, req.prompt if prompts == sent else prompts, prompts,
                             req.skip_special_tokens)  # a truncated prompt: its ids decoded
        echoes = [t for t in texts for _ in range(req.n)]
    renderer = CompletionRenderer(ctx, request_id, req.logprobs is not None, echoes,
                                  req.prompt_logprobs, choice_prompts,
                                  req.return_tokens_as_token_ids)
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
                 echoes: list[str] | None = None, prompt_logprobs: int | None = None,
                 prompts: list[list[int]] | None = None, as_ids: bool = False) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.want_logprobs = want_logprobs
        self.echoes = echoes  # per choice: the prompt text its text begins with (echo)
        self.prompt_logprobs = prompt_logprobs  # top n of the `prompt_logprobs` field
        self.prompts = prompts  # per choice: its prompt's token ids
        self.as_ids = as_ids  # return_tokens_as_token_ids
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
                *self._with_prompt(index, out.new_token_ids, out.logprobs or [],
                                   out.prompt_logprobs), self._offsets[index])
        if self.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.by_id(index, out.prompt_logprobs)
        if out.finished:
            choice["stop_reason"] = result.stop_reason
        return choice

    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            logprobs = (self.logprobs(*self._with_prompt(i, r.token_ids, r.logprobs,
                                                         r.prompt_logprobs or None), 0)[0]
                        if self.want_logprobs else None)
            text = "".join(r.text)
            if self.echoes is not None:
                text = self.echoes[i] + text
            choice = {"index": i, "text": text, "token_ids": r.token_ids, "logprobs": logprobs,
                      "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.by_id(i, r.prompt_logprobs)
            choices.append(choice)
        return {**self.envelope(), "choices": choices, "usage": usage}

    def _with_prompt(self, index: int, token_ids: list[int], logprobs: list[Logprobs],
                     prompt_logprobs: list[Logprobs] | None
                     ) -> tuple[list[int], list[Logprobs | None]]:
        """The tokens the legacy logprobs list: with echo, the prompt's first (in the output
        that carries the prompt's logprobs, the first one), its first token without any."""
        if self.echoes is None or prompt_logprobs is None or self.prompts is None:
            return token_ids, list(logprobs)
        prompt = self.prompts[index][:len(prompt_logprobs) + 1]  # (all of it but after a fault)
        return prompt + token_ids, [None, *prompt_logprobs, *logprobs]

    def logprobs(self, token_ids: list[int], logprobs: list[Logprobs | None],
                 offset: int) -> tuple[dict[str, Any], int]:
        """The legacy format for these tokens (None: a prompt's first token, null logprobs);
        text_offset continues from `offset`."""
        text, label = self.ctx.token_string, self.ctx.token_label(self.as_ids)
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            token = text(token_id)[0]
            tokens.append(label(token_id)[0])
            token_logprobs.append(None if lp is None else lp.token_logprob)
            entry: dict[str, float] | None = None if lp is None else {}
            for t, v in zip(*((lp.top_token_ids, lp.top_logprobs) if lp else ((), ()))):
                entry.setdefault(label(t)[0], v)  # tokens with the same text: keep the likeliest
            top.append(entry)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}, offset

    def by_id(self, index: int, entries: list[Logprobs]) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: null, then per prompt token {id: {logprob, decoded_token}}
        for the token itself and its top n."""
        text, prompt = self.ctx.token_string, self.prompts[index] if self.prompts else []
        n = self.prompt_logprobs or 0
        result: list[dict[str, Any] | None] = [None]
        for token_id, lp in zip(prompt[1:], entries):
            ids = [token_id, *lp.top_token_ids[:n]]
            values = [lp.token_logprob, *lp.top_logprobs[:n]]
            result.append({str(t): {"logprob": v, "decoded_token": text(t)[0]}
                           for t, v in zip(ids, values)})
        return result
