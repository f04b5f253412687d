"""The HTTP client: one streaming OpenAI request, timed, into a `RequestRecord`.

    send_request(session, cfg, item, record, origin)
      record.start  <- right before the POST (the caller holds the concurrency slot already)
      POST /v1/completions | /v1/chat/completions  {"stream": true, usage included}
      for each network read (one timestamp per read: lines that arrived together share it):
        split into lines (our own splitter: no line-length limit, see below) -> "data: ..."
        chunk with content -> chunk_times / chunk_tokens (TTFT is the first one)
        usage              -> usage_prompt_tokens / usage_completion_tokens
        any data line      -> latency (E2E: to the last line, "[DONE]" included)

NOTE: aiohttp's `async for line in response.content` stops at its 64 KB read-buffer line limit;
that made vLLM's benchmark numbers 10x wrong (vllm #39963). We read with `iter_any()` and split
lines ourselves, so a line of any size is parsed whole.

A chunk has content when it carries non-empty text (`text`, `delta.content` or
`delta.reasoning_content`) or token ids. Tokens per chunk come from the stream: moeserve sends
`choices[0].token_ids`; for servers that do not, each content chunk counts as one token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from moeserve.bench.records import RequestRecord
from moeserve.bench.workloads import WorkItem

READ_BUFSIZE = 10 * 1024 * 1024  # aiohttp's read buffer: 10 MB, as sglang's bench uses


BENCH_FIELDS = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature",
                          "stream", "stream_options", "messages", "prompt", "ignore_eos"})


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where and how requests are sent."""

    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the "model" field of each request
    api: str = "completions"  # "completions" | "chat"
    api_key: str | None = None  # sent as "Authorization: Bearer ..."
    ignore_eos: bool = True  # send "ignore_eos": true (moeserve, vLLM and SGLang accept it)
    timeout_s: float | None = None  # per request; None = no limit
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Fields added to every request (--extra-body), e.g. a response_format to bench
    structured outputs; the fields the bench sets itself are refused."""

    def __post_init__(self) -> None:
        if self.api not in ("completions", "chat"):
            raise ValueError(f"--api must be 'completions' or 'chat', got {self.api!r}")
        owned = sorted(set(self.extra_body) & BENCH_FIELDS)
        if owned:
            raise ValueError(f"--extra-body may not set {', '.join(owned)}: the bench sets "
                             "them (see its flags)")

    @property
    def endpoint(self) -> str:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_payload(cfg: ClientConfig, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    """The request body: greedy, streamed, usage in the last chunk."""
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.api == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat API needs text prompts (use --text-prompts)")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body | cfg.extra_body


class SSELineSplitter:
    """Bytes from the network -> complete lines (without the line break), any length."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        end = self._buf.rfind(b"\n")
        if end < 0:
            return []
        lines = bytes(self._buf[:end]).split(b"\n")
        del self._buf[: end + 1]
        return [line.rstrip(b"\r") for line in lines]

    def flush(self) -> list[bytes]:
        """What is left after the stream ends (a last line without a line break)."""
        rest, self._buf = bytes(self._buf).rstrip(b"\r"), bytearray()
        return [rest] if rest else []


def sse_data(line: bytes) -> bytes | None:
    """The payload of a "data:" line; None for blank lines, comments and other fields."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    token_ids: list[int] | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class Chunk(msgspec.Struct):
    """The fields of an OpenAI stream chunk that the bench reads (others are ignored)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(Chunk).decode


def chunk_tokens(chunk: Chunk) -> tuple[bool, int]:
    """(has content, tokens it carries) for one stream chunk."""
    if not chunk.choices:
        return False, 0
    c = chunk.choices[0]
    d = c.delta
    text = c.text
    if not text and d is not None:
        text = d.content or d.reasoning_content
    ids = c.token_ids if c.token_ids is not None else (d.token_ids if d is not None else None)
    if ids is not None:
        return bool(ids) or bool(text), len(ids)
    return bool(text), 1 if text else 0


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def handle_line(line: bytes, now: float, record: RequestRecord) -> None:
    """Fold one SSE line, received `now` seconds after the request's start, into `record`."""
    payload = sse_data(line)
    if payload is None or not payload:
        return
    record.latency = now
    if payload == b"[DONE]":
        return
    try:
        chunk = _decode_chunk(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        record.error = record.error or f"unparseable stream chunk ({e}): {payload[:200]!r}"
        return
    if chunk.error is not None:
        record.error = record.error or f"error in stream: {_error_text(chunk.error)}"
    has_content, n = chunk_tokens(chunk)
    if has_content:
        if not record.chunk_times:
            record.ttft = now
        record.chunk_times.append(now)
        record.chunk_tokens.append(n)
    if chunk.usage is not None:
        if chunk.usage.prompt_tokens is not None:
            record.usage_prompt_tokens = chunk.usage.prompt_tokens
        if chunk.usage.completion_tokens is not None:
            record.usage_completion_tokens = chunk.usage.completion_tokens


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    text = (await resp.text(errors="replace"))[:1000]
    try:
        msg = _error_text(msgspec.json.decode(text).get("error") or text)
    except (msgspec.DecodeError, AttributeError):
        msg = text.strip() or (resp.reason or "")
    return f"HTTP {resp.status}: {msg}"


def make_session(timeout_s: float | None) -> aiohttp.ClientSession:
    """One session per client process; no connection cap (the bench's semaphore is the cap)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), read_bufsize=READ_BUFSIZE,
        timeout=aiohttp.ClientTimeout(total=timeout_s))


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, item: WorkItem,
                       record: RequestRecord, origin: float,
                       clock: Callable[[], float] = time.perf_counter) -> None:
    """Send one request and stream its response into `record` (never raises for HTTP or
    network failures: they become `record.error`). `origin`: the run's start on `clock`."""
    body = msgspec.json.encode(build_payload(cfg, item.prompt, item.output_len))
    st = clock()
    record.start = st - origin
    try:
        async with session.post(cfg.endpoint, data=body, headers=cfg.headers()) as resp:
            record.status = resp.status
            if resp.status != 200:
                record.error = await _http_error(resp)
                return
            splitter = SSELineSplitter()
            async for data in resp.content.iter_any():
                now = clock() - st
                for line in splitter.feed(data):
                    if line:  # skip the blank lines between events
                        handle_line(line, now, record)
            for line in splitter.flush():
                handle_line(line, clock() - st, record)
    except asyncio.TimeoutError:
        record.error = f"timeout: no complete response within {cfg.timeout_s} s (--timeout)"
    except aiohttp.ClientError as e:
        record.error = f"{type(e).__name__}: {e}"
    if record.status == 200 and not record.error and not record.chunk_times:
        record.error = "the stream ended without any content"
    record.success = record.status == 200 and not record.error
