"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one assistant reply.

    messages, tools --apply_chat_template(add_generation_prompt=True, **chat_template_kwargs)
             --> text --encode(add_special_tokens=False)--> prompt token ids
    reply text --ReplyParser (server/agent/: reasoning, then tool calls)--> message / deltas

(the template already holds any BOS it wants). Text parts of a message are joined with "\\n".
Streaming: each choice first gets a delta {"role": "assistant", "content": ""}, then one delta
per engine step ({"content": ...}, or, when the reply is parsed, its reasoning_content, content
and whole tool calls as they are decided), with `token_ids` beside it (moeserve extension).
Without max_tokens / max_completion_tokens a reply may run to max_model_len, as in OpenAI's API.
Logprobs use the chat format: {"content": [{token, logprob, bytes, top_logprobs}]}.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from moeserve.server.agent.forced_calls import ForcedCallSplitter, forced_output
from moeserve.server.agent.protocol import NamedToolChoice
from moeserve.server.agent.reasoning import ReasoningSplitter
from moeserve.server.agent.reply import ReplyParser, ReplyPart
from moeserve.server.agent.strict_calls import strict_calls_output
from moeserve.server.agent.tool_formats import TOOL_FORMATS
from moeserve.server.agent.tool_splitter import ToolCallSplitter, ToolFormat
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
    truncate_prompts,
)
from moeserve.server.structured_output import requested_output
from moeserve.structured.spec import StructuredOutput
from moeserve.types import Logprobs, RequestOutput, SamplingParams


async def create_chat_completion(ctx: ServerContext, request: Request,
                                 request_id: str) -> Response:
    req = await parse_body(ctx, request, ChatCompletionRequest)
    check_model(ctx, req.model)
    check_messages([m.num_chars for m in req.messages], ctx.client.max_model_len,
                   ctx.max_prompt_chars)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    chat = await prepare_chat(ctx, req, field, req.num_logprobs)
    gen = Generation(ctx.client, request_id, [chat.prompt] * req.n, chat.params, "messages")
    renderer = ChatRenderer(ctx, request_id, req.logprobs, chat.new_parser, chat.named_call,
                            req.return_tokens_as_token_ids)
    return await serve(ctx, request, request_id, req, gen, renderer, [chat.prompt])


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A checked chat request, ready to generate."""

    prompt_text: str
    prompt: list[int]
    params: list[SamplingParams]  # per choice
    new_parser: Callable[[], ReplyParser] | None  # each choice's reply parser (None: plain)
    named_call: bool  # a forced call of a named function


async def prepare_chat(ctx: ServerContext, req: ChatCompletionRequest, max_tokens_field: str,
                       num_logprobs: int | None, continuation: str = "",
                       budget_optional: bool = False) -> PreparedChat:
    """The agent fields checked, the prompt rendered and checked against max_model_len, each
    choice's sampling params (with the reply's grammar and thinking_token_budget's reasoning
    budget) and reply parser. `continuation`: text the reply continues, appended after the
    template's generation prompt (the Messages API's prefill). `budget_optional`: a budget
    that cannot be enforced is left out, not a 400 (the Messages API's thinking budget).
    APIError 400 naming what is wrong."""
    check_agent_fields(ctx, req)
    prompt_text, prompt = await chat_prompt(ctx, req, continuation)
    prompt = truncate_prompts(req, [prompt], ctx.client.max_model_len)[0]
    check_lengths(ctx, [prompt], req.max_new_tokens, max_tokens_field, "messages")
    params = sampling_params(req, [prompt], req.max_new_tokens, None, num_logprobs,
                             ctx.client.max_model_len, chat_output(ctx, req, prompt_text),
                             ctx.sampling_defaults)
    agent = ctx.agent
    parsed = req.parses_tool_calls or agent.reasoning is not None
    if parsed and agent.keep_special_tokens:  # the markers are special tokens: keep them
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    if req.thinking_token_budget is not None and req.thinking_token_budget >= 0:
        budget = reasoning_budget(ctx, req.thinking_token_budget, prompt_text)
        if isinstance(budget, str) and not budget_optional:
            raise APIError(400, f"thinking_token_budget: {budget}", "thinking_token_budget")
        if not isinstance(budget, str):
            try:
                params = [dataclasses.replace(p, reasoning_budget=budget) for p in params]
            except ValueError as e:  # a field the budget contradicts (allowed_token_ids)
                raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None
    return PreparedChat(prompt_text, prompt, params, reply_parsers(ctx, req, prompt_text),
                        isinstance(req.tool_choice, NamedToolChoice))


def reasoning_budget(ctx: ServerContext, n: int, prompt_text: str
                     ) -> tuple[int, int, int] | str:
    """The engine's reasoning budget of n tokens (SamplingParams.reasoning_budget: the end
    marker forced once the reasoning has n tokens, counted from the reply's first token when
    the template opened the reasoning, else from the model's own start marker), or why it
    cannot be enforced: no reasoning format, or a marker that is not one token."""
    reasoning = ctx.agent.reasoning
    if reasoning is None:
        return ("this server reads no reasoning from the replies (--reasoning-parser), so it "
                "knows no marker to end it with")
    encode = ctx.client.tokenizer.encode
    end = encode(reasoning.end, add_special_tokens=False)
    start = [-1] if reasoning.starts_inside(prompt_text) else encode(
        reasoning.start, add_special_tokens=False)
    if len(end) != 1 or len(start) != 1:
        return (f"the reasoning's markers {reasoning.start!r} / {reasoning.end!r} are not one "
                "token each in this model's tokenizer, so the reasoning cannot be ended by one")
    return end[0], n, start[0]


def check_agent_fields(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    """What the request asks of tools and the template that this server cannot give: 400s."""
    if req.parses_tool_calls and not req.forces_call and ctx.agent.tools is None:
        raise APIError(400, f"tools: this server parses no tool calls "
                       f"({ctx.agent.tools_reason}); start it with --tool-call-parser NAME, "
                       "or send tool_choice \"none\"", "tools")
    check_template_kwargs(req.chat_template_kwargs)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs may not set what the server sets: a 400 naming it."""
    reserved = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {reserved[0]!r} is set by the server and "
                       "cannot be given here", "chat_template_kwargs")


RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt",
                                         "bos_token", "eos_token", "pad_token", "unk_token"})


async def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest,
                      continuation: str = "", generation_prompt: bool = True,
                      special_tokens: bool = False) -> tuple[str, list[int]]:
    """The rendered prompt (and `continuation` after it) and its token ids; /tokenize may
    leave the generation prompt out, and have the tokenizer add its special tokens."""
    tokenizer = ctx.client.tokenizer
    messages = [m.for_template() for m in req.messages]
    if tokenizer.chat_template is None:  # the default template: calls written in the format
        fmt = ctx.agent.tools or TOOL_FORMATS["hermes"]
        messages = [_calls_in_content(m, fmt) for m in messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    kwargs = req.chat_template_kwargs or {}

    def render() -> tuple[str, list[int]]:
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tools=tools, **kwargs)
        except Exception as e:  # a template's raise_exception, or a template bug
            text = _with_text_arguments(tokenizer, messages, tools, kwargs, generation_prompt)
            if text is None:
                raise APIError(400, f"the chat template refused these messages: {e}",
                               "messages") from None
        text += continuation
        return text, tokenizer.encode(text, add_special_tokens=special_tokens)

    return await tokenize_off_loop_if_large(sum(m.num_chars for m in req.messages), render)


def _with_text_arguments(tokenizer: Any, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None,
                         kwargs: dict[str, Any], generation_prompt: bool) -> str | None:
    """The template rendered with each call's arguments as JSON text, for templates that join
    them to strings (DeepSeek-V3's and V3.1's do: a mapping fails there, as transformers' docs
    would pass it); None when there are no calls, or it fails that way too."""
    if not any(m.get("tool_calls") for m in messages):
        return None
    as_text = [{**m, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.dumps(
            c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
        if m.get("tool_calls") else m for m in messages]
    try:
        return tokenizer.apply_chat_template(as_text, add_generation_prompt=generation_prompt,
                                             tools=tools, **kwargs)
    except Exception:
        return None


def _calls_in_content(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    calls = message.pop("tool_calls", None)
    if not calls:
        return message
    written = fmt.render([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    content = message.get("content") or ""
    return {**message, "content": f"{content}\n{written}" if content else written}


def chat_output(ctx: ServerContext, req: ChatCompletionRequest,
                prompt_text: str) -> StructuredOutput | None:
    """The reply's grammar: a forced call's, or response_format's / structured_outputs'. When
    the reply starts inside the model's reasoning, the grammar starts after its end marker,
    which must then be one token (else the JSON would land in the reasoning): a 400 otherwise."""
    strict_auto = False  # tool_choice "auto" with strict tools (agent/strict_calls.py)
    if req.forces_call:
        assert req.tools is not None and req.tool_choice is not None
        structured = forced_output(req.tools, req.tool_choice, req.parallel_tool_calls)
    else:
        structured = requested_output(req.response_format, req.structured_outputs)
        if structured is None and req.parses_tool_calls:
            structured = strict_auto_output(ctx, req)
            strict_auto = structured is not None
    reasoning = ctx.agent.reasoning
    if structured is None or reasoning is None or not reasoning.starts_inside(prompt_text):
        return structured
    end = ctx.client.tokenizer.encode(reasoning.end, add_special_tokens=False)
    if len(end) != 1 and strict_auto:  # strict under auto is kept where it can be: not here
        return None
    if len(end) != 1:
        field = "tool_choice" if req.forces_call else "response_format"
        raise APIError(400, f"{field}: the reply starts inside the model's reasoning, whose end "
                       f"marker {reasoning.end!r} is {len(end)} tokens, so the format cannot "
                       "start after it; turn the reasoning off (chat_template_kwargs, e.g. "
                       '{"enable_thinking": false}) or start the server with '
                       "--reasoning-parser none", field)
    return dataclasses.replace(structured, start_after=end[0])


def strict_auto_output(ctx: ServerContext, req: ChatCompletionRequest
                       ) -> StructuredOutput | None:
    """The grammar holding an auto reply's calls to their strict tools' schemas, where the
    server's tool-call format takes it and its opener is text the grammar can spell."""
    fmt = ctx.agent.tools
    if fmt is None or ctx.agent.strict_auto != "enforced":
        return None
    return strict_calls_output(fmt.name, fmt.start, fmt.end, req.tools or [],
                               req.parallel_tool_calls)


def reply_parsers(ctx: ServerContext, req: ChatCompletionRequest,
                  prompt_text: str) -> Callable[[], ReplyParser] | None:
    """A factory of each choice's reply parser; None when replies are plain content."""
    agent = ctx.agent
    tools = agent.tools if req.parses_tool_calls else None
    if tools is None and agent.reasoning is None and not req.forces_call:
        return None
    schemas = {t.function.name: t.function.parameters or {} for t in req.tools or ()}
    reasoning, inside = agent.reasoning, (agent.reasoning is not None
                                          and agent.reasoning.starts_inside(prompt_text))

    def new() -> ReplyParser:
        calls: ToolCallSplitter | ForcedCallSplitter | None = None
        if req.forces_call:
            assert req.tool_choice is not None
            calls = ForcedCallSplitter(req.tool_choice)
        elif tools is not None:
            calls = ToolCallSplitter(tools, schemas, req.parallel_tool_calls)
        return ReplyParser(reasoning and ReasoningSplitter(reasoning, inside), calls)

    return new


class ChatRenderer:
    def __init__(self, ctx: ServerContext, request_id: str, want_logprobs: bool,
                 new_parser: Callable[[], ReplyParser] | None = None,
                 named_call: bool = False, as_ids: bool = False) -> None:
        self.ctx = ctx
        self.as_ids = as_ids  # return_tokens_as_token_ids
        self.named_call = named_call  # a forced call of a named function: finish "stop", as
        # OpenAI's and vLLM's replies are
        self.request_id = request_id
        self.want_logprobs = want_logprobs
        self.new_parser = new_parser
        self.created = now()
        self._parsers: dict[int, ReplyParser] = {}  # per choice, while streaming
        self._calls_sent: dict[int, int] = {}

    def envelope(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.ctx.served_model}

    def head(self, num_choices: int) -> bytes:
        """The role delta of every choice, sent with the first content event."""
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "token_ids": [],
                    "logprobs": None, "finish_reason": None} for i in range(num_choices)]
        return b"".join(sse({**self.envelope(), "choices": [c]}) for c in choices)

    def chunk(self, index: int, out: RequestOutput, result: ChoiceResult) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": out.text}
        finish_reason = result.finish_reason
        if self.new_parser is not None:
            parser = self._parsers.get(index) or self._parsers.setdefault(index,
                                                                          self.new_parser())
            part = parser.feed(out.text, final=out.finished)
            sent = self._calls_sent.get(index, 0)
            delta = _delta(part, sent)
            self._calls_sent[index] = sent + len(part.calls)
            finish_reason = self._finish_reason(finish_reason, parser.num_calls)
        choice: dict[str, Any] = {"index": index, "delta": delta,
                                  "token_ids": out.new_token_ids, "logprobs": None,
                                  "finish_reason": finish_reason}
        if self.want_logprobs:
            choice["logprobs"] = self.logprobs(out.new_token_ids, out.logprobs or [])
        if out.finished:
            choice["stop_reason"] = result.stop_reason
        return choice

    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            message, finish_reason = self.message("".join(r.text), r.finish_reason)
            choices.append({"index": i, "message": message, "token_ids": r.token_ids,
                            "logprobs": self.logprobs(r.token_ids, r.logprobs)
                            if self.want_logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": r.stop_reason})
        return {**self.envelope(), "object": "chat.completion", "choices": choices,
                "usage": usage}

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[dict[str, Any], str | None]:
        """A whole reply's message, and its finish reason ("tool_calls" when it called)."""
        if self.new_parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        parser = self.new_parser()
        part = parser.feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": part.content or (None if part.calls else "")}
        if parser.reasoning is not None:
            message["reasoning_content"] = part.reasoning or None
        if part.calls:
            message["tool_calls"] = part.calls
        return message, self._finish_reason(finish_reason, parser.num_calls)

    def _finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's "tool_calls" for a reply that called and ended by itself (but "stop" for
        the forced call of a named function)."""
        called = num_calls and not self.named_call
        return "tool_calls" if engine_reason == "stop" and called else engine_reason

    def logprobs(self, token_ids: list[int], logprobs: list[Logprobs]) -> dict[str, Any]:
        text = self.ctx.token_label(self.as_ids)
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


def _delta(part: ReplyPart, calls_sent: int) -> dict[str, Any]:
    """A streamed delta of a parsed reply: its reasoning, content and whole calls (indexed
    across the choice's stream); {"content": ""} when this step decided nothing."""
    delta: dict[str, Any] = {}
    if part.reasoning:
        delta["reasoning_content"] = part.reasoning
    if part.content or not (part.reasoning or part.calls):
        delta["content"] = part.content
    if part.calls:
        delta["tool_calls"] = [{"index": calls_sent + k, **call}
                               for k, call in enumerate(part.calls)]
    return delta

