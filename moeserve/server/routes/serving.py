"""What /v1/completions and /v1/chat/completions share: parsing, sampling params, the streaming
and non-streaming drivers, and usage.

    request body --parse_body--> pydantic request --sampling_params--> SamplingParams per choice
        --Generation.start()--> stream: SSEResponse(stream_events(...))
                                else:   collect(...) -> per-choice ChoiceResult -> JSON

An endpoint supplies a `Renderer`: how one engine output becomes one SSE event (completions:
"text"; chat: "delta"), what opens the stream (chat: the role), and the final JSON. Streamed
events are built as dicts and encoded with msgspec (pydantic is for parsing); the tests check
them against the chunk models of protocol.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from moeserve.engine.validate import validate_request
from moeserve.server.agent.choice import AgentFormats
from moeserve.server.errors import APIError, from_validation_error
from moeserve.server.metrics import RequestTimer, ServerMetrics
from moeserve.server.protocol import SamplingFields
from moeserve.server.responses.background import BackgroundResponses
from moeserve.server.responses.store import ResponseStore
from moeserve.server.routes.generation import (
    DisconnectWatch,
    Generation,
    SSEResponse,
    engine_error,
    named,
)
from moeserve.server.routes.request_limits import MAX_BODY_BYTES, max_prompt_chars, precheck_body
from moeserve.structured.spec import StructuredOutput
from moeserve.types import Logprobs, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from moeserve.engine.process.async_client import AsyncEngineClient

logger = logging.getLogger("moeserve.server")
_encode = msgspec.json.Encoder().encode
RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass
class ServerContext:
    """What the routes need, built once by build_app."""

    client: AsyncEngineClient
    metrics: ServerMetrics
    model_names: frozenset[str]  # names a request's "model" may use
    api_key: str | None
    settings: dict[str, Any] = field(default_factory=dict)
    agent: AgentFormats = field(default_factory=lambda: AgentFormats(None, "none", None, "none"))
    """The tool-call and reasoning formats chat replies are parsed in (server/agent/)."""
    shut_down: bool = False
    responses: ResponseStore = field(default_factory=ResponseStore)
    """The Responses API's stored responses (server/responses/store.py)."""
    background: BackgroundResponses = field(init=False)
    """The background responses this process runs (server/responses/background.py)."""
    _token_strings: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.background = BackgroundResponses(self.responses)

    @property
    def served_model(self) -> str:
        return self.client.model_name

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's, for the fields a request leaves out (hf_config/generation.py)."""
        return self.client.sampling_defaults

    @property
    def max_prompt_chars(self) -> int:
        """Longer text cannot fit in max_model_len tokens (request_limits.py)."""
        return max_prompt_chars(self.client.max_model_len,
                                self.client.tokenizer.max_token_chars())

    def token_label(self, as_ids: bool) -> Callable[[int], tuple[str, list[int]]]:
        """How logprobs name a token: its text and bytes (`token_string`), or with
        return_tokens_as_token_ids "token_id:<id>" and its bytes."""
        if not as_ids:
            return self.token_string
        return lambda token_id: (f"token_id:{token_id}", self.token_string(token_id)[1])

    def token_string(self, token_id: int) -> tuple[str, list[int]]:
        """A token's own text and bytes, as logprobs show it (special tokens included)."""
        hit = self._token_strings.get(token_id)
        if hit is None:
            raw = self.client.tokenizer.token_bytes([token_id], skip_special_tokens=False)[0]
            hit = self._token_strings[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return hit


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def parse_body(ctx: ServerContext, request: Request, model: type[RequestT]) -> RequestT:
    """Read and validate a JSON body; APIError 400/413 naming what is wrong. A big body gets
    the request limits first, off the event loop (request_limits.py)."""
    body = await read_body(request)
    await precheck_body(body, ctx.client.max_model_len, ctx.max_prompt_chars)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def read_body(request: Request) -> bytes:
    """The body, up to MAX_BODY_BYTES (APIError 413 beyond)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    return bytes(body)


def check_model(ctx: ServerContext, name: str | None) -> None:
    if name is not None and name not in ctx.model_names:
        raise APIError(404, f"the model '{name}' does not exist; this server serves "
                       f"'{ctx.served_model}'", "model")


def truncate_prompts(req: SamplingFields, prompts: list[list[int]],
                     max_model_len: int) -> list[list[int]]:
    """Each prompt's last truncate_prompt_tokens tokens (-1: max_model_len - 1), as vLLM's
    truncate_prompt_tokens keeps them; the prompts as they are without it."""
    n = req.truncate_prompt_tokens
    if n is None:
        return prompts
    keep = max_model_len - 1 if n == -1 else n
    return [p[-keep:] if len(p) > keep else p for p in prompts]


def check_lengths(ctx: ServerContext, prompts: list[list[int]], max_tokens: int | None,
                  max_tokens_field: str, prompt_field: str) -> None:
    """Bad prompts and max_tokens beyond the context are 400s before anything is submitted."""
    client = ctx.client
    limit = client.max_model_len
    for i, prompt in enumerate(prompts):
        where = f"{prompt_field} {i}: " if len(prompts) > 1 else ""
        try:
            validate_request(prompt, SamplingParams(), client.model_config.vocab_size, limit)
        except ValueError as e:
            raise APIError(400, named(prompt_field, f"{where}{e}"), prompt_field) from None
        if max_tokens is not None and len(prompt) + max_tokens > limit:
            raise APIError(400, f"{where}{max_tokens_field} is too large: the prompt has "
                           f"{len(prompt)} tokens and max_model_len is {limit}, so at most "
                           f"{limit - len(prompt)} tokens can be generated", max_tokens_field)


def sampling_params(req: SamplingFields, prompts: list[list[int]], max_tokens: int | None,
                    default_max_tokens: int | None, logprobs: int | None,
                    max_model_len: int, structured: StructuredOutput | None = None,
                    defaults: dict[str, Any] | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice: prompt-major, n per prompt; seed + i for choice i of a
    prompt. Without max_tokens: default_max_tokens, or up to max_model_len when that is None
    (capped by max_model_len and the model's max_new_tokens). The number of choices is checked
    before (request limits). `structured`: every choice's grammar. `defaults`: the model's
    sampling defaults for the fields the request leaves out (hf_config/generation.py)."""
    out, model = [], defaults or {}

    def given(name: str, neutral: Any) -> Any:
        value = getattr(req, name)
        return model.get(name, neutral) if value is None else value

    for prompt in prompts:
        room = max_model_len - len(prompt)
        limit = max_tokens or min(default_max_tokens or room, room, model.get("max_tokens", room))
        for i in range(req.n):
            try:
                out.append(SamplingParams(
                    max_tokens=limit, min_tokens=req.min_tokens,
                    temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
                    top_k=given("top_k", 0), min_p=given("min_p", 0.0),
                    repetition_penalty=given("repetition_penalty", 1.0),
                    seed=None if req.seed is None else req.seed + i,
                    stop=req.stop_strings, stop_token_ids=tuple(req.stop_token_ids or ()),
                    ignore_eos=req.ignore_eos, logprobs=logprobs,
                    logit_bias=req.logit_bias_pairs,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    skip_special_tokens=req.skip_special_tokens, structured=structured,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    allowed_token_ids=req.allowed_token_ids))
            except ValueError as e:
                raise APIError(400, str(e), str(e).split(" ", 1)[0]) from None
    return out


def usage_dict(prompts: list[list[int]], results: list[ChoiceResult], n: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once (not n times), every choice's tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(r.num_tokens for r in results)
    cached = sum(results[i * n].num_cached_tokens for i in range(len(prompts)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass(slots=True)
class ChoiceResult:
    """One choice's outputs so far."""

    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # kept only when not streaming
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs] = field(default_factory=list)  # prompt[1:]'s, when asked

    def add(self, out: RequestOutput, keep: bool) -> None:
        self.num_tokens += len(out.new_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if keep:
            self.token_ids += out.new_token_ids
            self.text.append(out.text)
            if out.logprobs:
                self.logprobs += out.logprobs
            if out.prompt_logprobs:
                self.prompt_logprobs += out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason.value if out.finish_reason else "stop"
            self.stop_reason = out.stop_reason


class FinalRenderer(Protocol):
    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed response."""
        ...


LogEnd = Callable[[list[ChoiceResult], str | None], None]
StreamEvents = Callable[[Generation, RequestTimer, LogEnd], AsyncIterator[bytes]]
"""A route's own event stream (the Messages API's): every event of a streamed response, the
engine's failures included (the generation is started; the stream must aclose it)."""


class Renderer(FinalRenderer, Protocol):
    """The endpoint-specific shapes of the OpenAI routes' responses."""

    def head(self, num_choices: int) -> bytes:
        """Events sent before the first output (b"" for none)."""
        ...

    def chunk(self, index: int, out: RequestOutput, result: ChoiceResult) -> dict[str, Any]:
        """One choice of one streamed event (`result` has already taken `out`)."""
        ...

    def envelope(self) -> dict[str, Any]:
        """id, object, created, model of every streamed event."""
        ...


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else _encode(payload)
    return b"data: " + data + b"\n\n"


async def collect(gen: Generation, timer: RequestTimer) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(gen.num_choices)]
    async for i, out in gen.outputs():
        results[i].add(out, keep=True)
        timer.on_tokens(i, len(out.new_token_ids))
        if out.finished:
            timer.on_finished(i, results[i].finish_reason or "stop")
    timer.on_done()
    return results


async def stream_events(gen: Generation, renderer: Renderer, timer: RequestTimer,
                        prompts: list[list[int]], n: int, include_usage: bool,
                        log_end: LogEnd) -> AsyncIterator[bytes]:
    """One SSE event per engine step per choice, then usage (when asked) and [DONE]. An engine
    failure mid-stream becomes an error event, then the stream ends."""
    results = [ChoiceResult() for _ in range(gen.num_choices)]
    envelope = renderer.envelope()
    prefix = _encode(envelope)[:-1] + b',"choices":['  # the envelope's JSON, left open
    error: str | None = "client went away"
    try:
        first = renderer.head(gen.num_choices)
        async for i, out in gen.outputs():
            results[i].add(out, keep=False)
            timer.on_tokens(i, len(out.new_token_ids))
            if out.finished:
                timer.on_finished(i, results[i].finish_reason or "stop")
            event = b"data: " + prefix + _encode(renderer.chunk(i, out, results[i])) + b"]}\n\n"
            if first:
                event, first = first + event, b""
            yield event
        timer.on_done()
        error = None
        if include_usage:
            yield sse({**envelope, "choices": [], "usage": usage_dict(prompts, results, n)})
    except Exception as e:  # the engine died or failed: tell the client, end the stream
        api_error = engine_error(e, None)
        error = api_error.message
        yield sse(api_error.to_dict())
    finally:
        await gen.aclose()
        log_end(results, error)
    yield b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())


async def serve(ctx: ServerContext, request: Request, request_id: str, req: SamplingFields,
                gen: Generation, renderer: FinalRenderer, prompts: list[list[int]],
                events: StreamEvents | None = None) -> Response:
    """Run a validated request: start its generation, then stream it (the OpenAI routes'
    stream_events with `renderer`, or the route's own `events`) or answer once."""
    timer = RequestTimer(ctx.metrics, gen.num_choices)
    watch = DisconnectWatch(request.receive)

    def gone() -> Response:
        ctx.metrics.disconnects.inc()
        logger.debug("%s: the client went away", request_id)
        return Response(status_code=499)

    def log_end(results: list[ChoiceResult], error: str | None) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: %s; user=%s prompt_tokens=%d output_tokens=%s finish=%s %.3fs",
                         request_id, error or "done", req.user, sum(len(p) for p in prompts),
                         [r.num_tokens for r in results], [r.finish_reason for r in results],
                         time.perf_counter() - timer.start)

    try:
        await gen.start()
    except asyncio.CancelledError:
        if watch.absorb():
            return gone()
        raise
    except BaseException:
        watch.close()
        raise
    ctx.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    headers = {"X-Request-Id": request_id}
    if req.stream:
        stream = events(gen, timer, log_end) if events is not None else stream_events(
            gen, cast(Renderer, renderer), timer, prompts, req.n, req.include_usage, log_end)
        return SSEResponse(stream, watch, ctx.metrics.disconnects.inc, headers)
    try:
        results = await collect(gen, timer)
    except asyncio.CancelledError:
        if watch.absorb():
            return gone()
        raise
    except Exception as e:
        raise engine_error(e, None) from None
    finally:
        watch.close()
        await gen.aclose()
    log_end(results, None)
    body = renderer.final(results, usage_dict(prompts, results, req.n))
    return Response(_encode(body), headers=headers, media_type="application/json")
