"""The client: SSE parsing, chunk token counts, the timestamps of a stream (on a fake clock),
and requests against a real test server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from moeserve.bench.client import (
    ClientConfig,
    SSELineSplitter,
    _decode_chunk,
    build_payload,
    chunk_tokens,
    handle_line,
    make_session,
    send_request,
)
from moeserve.bench.metrics import request_itls
from moeserve.bench.records import RequestRecord
from moeserve.bench.workloads import WorkItem
from tests.bench.fake_server import FakeServer


def _rec(max_tokens: int = 8) -> RequestRecord:
    return RequestRecord(index=0, prompt_len=3, max_tokens=max_tokens)


def _send(server: FakeServer, item: WorkItem, api: str = "completions",
          ignore_eos: bool = True) -> RequestRecord:
    cfg = ClientConfig(base_url=server.url, model="fake-model", api=api, ignore_eos=ignore_eos,
                       timeout_s=10)
    rec = _rec(item.output_len)

    async def go() -> None:
        async with make_session(cfg.timeout_s) as session:
            await send_request(session, cfg, item, rec, time.perf_counter())

    asyncio.run(go())
    return rec


def test_line_splitter_partial_and_huge_lines() -> None:
    sp = SSELineSplitter()
    assert sp.feed(b"data: {\"a\"") == []
    assert sp.feed(b": 1}\r\n\r\ndata: [DO") == [b'data: {"a": 1}', b""]
    big = b"data: " + b"z" * 200_000  # > aiohttp's 64 KB line limit
    lines = sp.feed(b"NE]\n" + big[:70_000])
    assert lines == [b"data: [DONE]"]
    assert sp.feed(big[70_000:140_000]) == []
    assert sp.feed(big[140_000:] + b"\n") == [big]
    assert sp.feed(b"data: tail-without-newline") == []
    assert sp.flush() == [b"data: tail-without-newline"]


def test_chunk_token_counts() -> None:
    def count(obj: dict) -> tuple[bool, int]:
        return chunk_tokens(_decode_chunk(json.dumps(obj).encode()))

    assert count({"choices": [{"text": "abc", "token_ids": [1, 2, 3]}]}) == (True, 3)
    assert count({"choices": [{"text": "", "token_ids": [9]}]}) == (True, 1)  # partial UTF-8
    assert count({"choices": [{"text": "hi"}]}) == (True, 1)  # foreign server: 1 per chunk
    assert count({"choices": [{"text": ""}]}) == (False, 0)
    assert count({"choices": [{"delta": {"content": "yo"}}]}) == (True, 1)
    assert count({"choices": [{"delta": {"role": "assistant"}}]}) == (False, 0)
    assert count({"choices": [{"delta": {"reasoning_content": "hmm"}}]}) == (True, 1)
    assert count({"choices": [], "usage": {"completion_tokens": 4}}) == (False, 0)
    assert count({"choices": None, "usage": None}) == (False, 0)
    assert count({"choices": [{"text": None, "token_ids": None, "logprobs": None}]}) == (False, 0)


def test_handle_line_usage_done_and_errors() -> None:
    rec = _rec()
    handle_line(b'data: {"choices": [{"text": "ab", "token_ids": [5, 6]}]}', 0.5, rec)
    handle_line(b": keep-alive comment", 0.6, rec)
    handle_line(b'data: {"choices": [{"text": "c", "token_ids": [7]}]}', 0.7, rec)
    handle_line(b'data: {"choices": [], "usage": {"prompt_tokens": 3, '
                b'"completion_tokens": 3}}', 0.8, rec)
    handle_line(b"data: [DONE]", 0.9, rec)
    assert rec.ttft == 0.5 and rec.chunk_times == [0.5, 0.7] and rec.chunk_tokens == [2, 1]
    assert rec.latency == 0.9  # E2E runs to the last line, [DONE] included
    assert (rec.usage_prompt_tokens, rec.usage_completion_tokens) == (3, 3)
    assert rec.streamed_tokens == 3 and not rec.error
    bad = _rec()
    handle_line(b'data: {"error": {"message": "engine died", "code": 500}}', 0.1, bad)
    assert bad.error == "error in stream: engine died"
    junk = _rec()
    handle_line(b"data: {oops", 0.1, junk)
    assert junk.error.startswith("unparseable stream chunk")


def test_payload() -> None:
    cfg = ClientConfig(base_url="http://h:1", model="m")
    body = build_payload(cfg, [1, 2], 16)
    assert body == {"model": "m", "prompt": [1, 2], "max_tokens": 16, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
    assert cfg.endpoint == "http://h:1/v1/completions"
    chat = ClientConfig(base_url="http://h:1/", model="m", api="chat", ignore_eos=False)
    body = build_payload(chat, "hi", 4)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in body
    assert chat.endpoint == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="chat API needs text prompts"):
        build_payload(chat, [1, 2], 4)
    with pytest.raises(ValueError, match="--api must be"):
        ClientConfig(base_url="http://h:1", model="m", api="generate")
    assert ClientConfig("http://h", "m", api_key="k").headers()["Authorization"] == "Bearer k"


def test_extra_body_is_added_to_every_request_but_not_over_the_benchs_fields() -> None:
    fmt = {"response_format": {"type": "json_object"}, "top_k": 5}
    cfg = ClientConfig(base_url="http://h:1", model="m", extra_body=fmt)
    body = build_payload(cfg, [1, 2], 16)
    assert body["response_format"] == {"type": "json_object"} and body["top_k"] == 5
    assert body["max_tokens"] == 16 and body["stream"] is True
    with pytest.raises(ValueError, match="may not set max_tokens, stream"):
        ClientConfig(base_url="http://h:1", model="m", extra_body={"stream": False,
                                                                    "max_tokens": 1})


def _data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _tokens(ids: list[int]) -> bytes:
    return _data({"choices": [{"text": "x" * len(ids), "token_ids": ids}]})


class ScriptedResponse:
    """Stands in for aiohttp's session and its 200 response: `reads` are (clock time, bytes);
    each read arrives when the fake clock shows its time."""

    status = 200

    def __init__(self, clock: SimpleNamespace, reads: list[tuple[float, bytes]]) -> None:
        self.clock, self.reads, self.content = clock, reads, self
        self.posts: list[dict[str, Any]] = []

    def post(self, url: str, **kwargs: Any) -> ScriptedResponse:
        self.posts.append({"url": url, **kwargs})
        return self

    async def __aenter__(self) -> ScriptedResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def iter_any(self) -> AsyncIterator[bytes]:
        for at, data in self.reads:
            self.clock.now = at
            yield data


def test_stream_timestamps_count_from_the_request_start() -> None:
    clock = SimpleNamespace(now=100.0)
    split = _tokens([1, 2, 3])
    usage = _data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    reads = [(100.25, _tokens([0])),  # the first token 0.25 s after the request went out
             (100.375, split[:12]),  # a line cut in two reads counts when it is complete
             (100.5, split[12:]),
             (100.75, _tokens([4]) + usage + b"data: [DONE]\n\n")]  # lines read together
    session = ScriptedResponse(clock, reads)
    cfg = ClientConfig(base_url="http://h:1", model="fake-model")
    rec = _rec(5)
    asyncio.run(send_request(session, cfg, WorkItem([1, 2, 3], 3, 5), rec, 99.0,
                             clock=lambda: clock.now))
    assert rec.success and rec.status == 200, rec.error
    assert session.posts[0]["url"] == "http://h:1/v1/completions"
    assert rec.start == 1.0  # from the run's origin to the POST
    assert rec.ttft == 0.25 and rec.chunk_times == [0.25, 0.5, 0.75]
    assert rec.chunk_tokens == [1, 3, 1] and rec.streamed_tokens == 5
    assert request_itls(rec) == pytest.approx([0.25 / 3] * 3 + [0.25])
    assert rec.latency == 0.75  # to [DONE], which came with the last token
    assert (rec.usage_prompt_tokens, rec.usage_completion_tokens) == (3, 5)


def test_stream_against_server(fake_server: FakeServer) -> None:
    # 1 token, then chunks of 3 and 1 tokens, over the network (timestamps: the test above)
    fake_server.state.options.delay_s = 0.01
    fake_server.state.options.chunk_sizes = [1, 3, 1]
    rec = _send(fake_server, WorkItem([1, 2, 3], 3, 5))
    assert rec.success and rec.status == 200, rec.error
    assert rec.chunk_tokens == [1, 3, 1]
    assert rec.streamed_tokens == 5 == rec.usage_completion_tokens
    assert rec.usage_prompt_tokens == 3
    assert rec.ttft == rec.chunk_times[0] and rec.chunk_times == sorted(rec.chunk_times)
    assert rec.latency >= rec.chunk_times[-1]
    sent = fake_server.state.bodies[0]
    assert sent["prompt"] == [1, 2, 3] and sent["ignore_eos"] is True
    assert sent["stream_options"] == {"include_usage": True} and sent["max_tokens"] == 5


def test_chat_stream_without_token_ids(fake_server: FakeServer) -> None:
    fake_server.state.options.send_token_ids = False
    fake_server.state.options.chunk_sizes = [2]
    rec = _send(fake_server, WorkItem("hello there", 2, 6), api="chat", ignore_eos=False)
    assert rec.success, rec.error
    assert rec.chunk_tokens == [1, 1, 1]  # one per chunk without token_ids
    assert rec.usage_completion_tokens == 6 and rec.output_len == 6  # usage wins
    assert fake_server.state.bodies[0]["messages"][0]["content"] == "hello there"
    assert "ignore_eos" not in fake_server.state.bodies[0]


def test_chunk_larger_than_64kb(fake_server: FakeServer) -> None:
    fake_server.state.options.huge_text_bytes = 300_000
    rec = _send(fake_server, WorkItem([1], 1, 4))
    assert rec.success, rec.error
    assert rec.chunk_tokens == [1, 1, 1, 1] and rec.usage_completion_tokens == 4


def test_http_error_and_unreachable(fake_server: FakeServer) -> None:
    fake_server.state.options.fail_status = 503
    rec = _send(fake_server, WorkItem([1], 1, 4))
    assert not rec.success and rec.status == 503
    assert rec.error == "HTTP 503: injected failure"
    cfg = ClientConfig(base_url="http://127.0.0.1:9", model="m", timeout_s=5)
    down = _rec()

    async def go() -> None:
        async with make_session(5) as session:
            await send_request(session, cfg, WorkItem([1], 1, 4), down, time.perf_counter())

    asyncio.run(go())
    assert not down.success and down.status is None
    assert "ClientConnectorError" in down.error


def test_timeout(fake_server: FakeServer) -> None:
    fake_server.state.options.first_delay_s = 2.0
    cfg = ClientConfig(base_url=fake_server.url, model="m", timeout_s=0.3)
    rec = _rec()

    async def go() -> None:
        async with make_session(cfg.timeout_s) as session:
            await send_request(session, cfg, WorkItem([1], 1, 2), rec, time.perf_counter())

    asyncio.run(go())
    assert not rec.success and rec.error.startswith("timeout")
