"""A small OpenAI-style streaming server for the bench's tests (aiohttp.web).

It streams a known timeline: `first_delay_s`, then chunks of `chunk_sizes` tokens (cycled) every
`delay_s`, then a usage chunk and [DONE]. It counts requests in flight (the peak is
`max_in_flight`) and keeps the request bodies. With `gather` N, the first N requests wait for one
another (all N in flight) before they stream, so a test sees a concurrency reached however slow
the machine. `FakeServer` runs it in a thread with its own event loop, so code under test may
call asyncio.run itself.

Run standalone (`python -m tests.bench.fake_server --port 8123`) to measure the client's rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeOptions:
    first_delay_s: float = 0.0
    delay_s: float = 0.0
    chunk_sizes: list[int] = field(default_factory=lambda: [1])
    send_token_ids: bool = True  # moeserve-style choices[0].token_ids
    send_usage: bool = True
    text_per_token: str = "x"  # text of each token ("" = token ids only)
    huge_text_bytes: int = 0  # > 0: the first chunk's text is this long
    fail_status: int | None = None  # answer every request with this status
    usage_extra_tokens: int = 0  # report usage.completion_tokens off by this much
    gather: int = 0  # the first `gather` requests wait until that many are in flight (10 s at most)
    engine: dict[str, Any] | None = field(default_factory=lambda: {
        "capacity_report": {"engine_config": {"device": "cpu", "max_model_len": 4096},
                            "model": "fake", "vocab_size": 1000}})


class FakeState:
    def __init__(self, options: FakeOptions) -> None:
        self.options = options
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []


def _chunk(api: str, text: str, ids: list[int] | None) -> dict[str, Any]:
    if api == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
    else:
        choice = {"index": 0, "text": text}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-1", "object": "chunk", "choices": [choice]}


async def _stream(request: web.Request, state: FakeState, api: str) -> web.StreamResponse:
    opts = state.options
    body = await request.json()
    state.bodies.append(body)
    if opts.fail_status is not None:
        return web.json_response({"error": {"message": "injected failure"}},
                                 status=opts.fail_status)
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        if len(state.bodies) <= opts.gather:
            await _gathered(state, opts.gather)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n_total, sent, i = int(body["max_tokens"]), 0, 0
        await asyncio.sleep(opts.first_delay_s)
        while sent < n_total:
            n = min(opts.chunk_sizes[i % len(opts.chunk_sizes)], n_total - sent)
            text = opts.text_per_token * n
            if i == 0 and opts.huge_text_bytes:
                text = "y" * opts.huge_text_bytes
            ids = list(range(sent, sent + n)) if opts.send_token_ids else None
            await resp.write(b"data: " + json.dumps(_chunk(api, text, ids)).encode() + b"\n\n")
            sent, i = sent + n, i + 1
            if sent < n_total:
                await asyncio.sleep(opts.delay_s)
        if opts.send_usage:
            prompt = body.get("prompt", body.get("messages"))
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 7,
                     "completion_tokens": n_total + opts.usage_extra_tokens}
            final = {"id": "cmpl-1", "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        state.in_flight -= 1


async def _gathered(state: FakeState, n: int, timeout_s: float = 10.0) -> None:
    """Until `n` requests are in flight; past `timeout_s` go on (max_in_flight then says so)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while state.max_in_flight < n and loop.time() < deadline:
        await asyncio.sleep(0.001)


def make_app(state: FakeState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        return await _stream(request, state, "completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _stream(request, state, "chat")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    async def engine(request: web.Request) -> web.Response:
        if state.options.engine is None:
            raise web.HTTPNotFound()
        return web.json_response(state.options.engine)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/engine", engine)
    app.router.add_get("/ready", ready)
    return app


class FakeServer:
    """The app on 127.0.0.1:<free port> in a background thread; `with FakeServer() as s`."""

    def __init__(self, options: FakeOptions | None = None) -> None:
        self.state = FakeState(options or FakeOptions())
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _start(self) -> str:
        self._runner = web.AppRunner(make_app(self.state), shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> FakeServer:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def main() -> None:
    """Standalone; also takes `serve --host H --port P --preset X` like `moeserve serve`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="?")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--delay", type=float, default=0.0)
    a, _ = p.parse_known_args()
    print(f"fake server on port {a.port}", flush=True)  # a line in the bench's server log
    web.run_app(make_app(FakeState(FakeOptions(delay_s=a.delay))), host=a.host, port=a.port,
                print=None)


if __name__ == "__main__":
    main()
