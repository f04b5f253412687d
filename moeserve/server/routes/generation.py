"""The engine side of one HTTP request: its engine requests, their merged outputs, and the client.

    Generation.start()    submit one engine request per choice ("{id}" alone, "{id}-{i}" for
                          several) and wait for each one's first output; a refusal (bad input,
                          full queue, dead engine) raises APIError before any byte is sent
    Generation.outputs()  (choice index, RequestOutput) per engine step per choice, in arrival
                          order, until every choice has finished
    Generation.aclose()   abort what has not finished (frees its KV in the engine)

One choice is iterated directly (no task, no queue: the hot path). Several run one task each,
merged through a queue.

`DisconnectWatch` waits for the client's http.disconnect and then cancels the request's task: the
cancellation lands in whatever the task awaits (an engine output, a socket write), the engine
generator's cleanup aborts the request, and the route returns quietly. `SSEResponse` streams
events and owns that cleanup once the headers are out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from moeserve.server.errors import APIError
from moeserve.structured.grammars import GRAMMAR_FAILED
from moeserve.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from moeserve.engine.process.async_client import AsyncEngineClient

logger = logging.getLogger("moeserve.server")


def named(param: str | None, message: str) -> str:
    """The message, led by the field's name unless it already says it."""
    return message if param is None or param in message else f"{param}: {message}"


def engine_error(exc: BaseException, param: str | None) -> APIError:
    """The HTTP error for an exception raised by AsyncEngineClient.generate."""
    from moeserve.engine.process.async_client import (
        EngineDeadError,
        QueueFullError,
        RequestFailedError,
    )

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, f"the server is full, retry later: {exc}",
                        headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is unavailable: {exc}")
    if isinstance(exc, RequestFailedError) and str(exc).startswith(GRAMMAR_FAILED):
        return APIError(400, str(exc))  # the request's grammar exceeded a parser limit
    if isinstance(exc, RequestFailedError):  # this request's own fault; the server goes on
        logger.warning("a request failed in the engine: %s", exc)
        return APIError(500, f"the request failed in the engine: {exc}")
    if isinstance(exc, ValueError):
        message = str(exc)
        param = ("stop_token_ids" if "stop token" in message else
                 "logit_bias" if message.startswith("logit_bias") else
                 "allowed_token_ids" if message.startswith("allowed_token_ids") else
                 "X-Request-Id" if "request id" in message else param)
        return APIError(400, named(param, message), param)
    logger.error("unexpected engine error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


class Generation:
    """The engine requests of one HTTP request, one per choice, merged into one stream."""

    def __init__(self, client: AsyncEngineClient, request_id: str,
                 prompts: list[list[int]], params: list[SamplingParams],
                 param_name: str) -> None:
        self.client = client
        self.prompts = prompts  # per choice
        self.params = params  # per choice
        self.param_name = param_name  # the field a refusal names ("prompt", "messages")
        single = len(prompts) == 1
        self.request_ids = [request_id] if single else [f"{request_id}-{i}"
                                                         for i in range(len(prompts))]
        self._pending: list[tuple[int, RequestOutput]] = []
        self._gens: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue | None = None
        self._num_done = 0

    @property
    def num_choices(self) -> int:
        return len(self.prompts)

    async def start(self) -> None:
        """Submit every choice and wait for each one's first output (see module doc)."""
        self._gens = [self.client.generate(rid, prompt, params) for rid, prompt, params
                      in zip(self.request_ids, self.prompts, self.params)]
        try:
            if len(self._gens) == 1:
                self._pending.append((0, await self._first(self._gens[0])))
            else:
                await self._start_tasks()
        except (Exception, asyncio.CancelledError) as e:
            await self.aclose()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise engine_error(e, self.param_name) from None

    @staticmethod
    async def _first(gen: Any) -> RequestOutput:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            raise RuntimeError("the engine ended a request without any output") from None

    async def _start_tasks(self) -> None:
        self._queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, gen)) for i, gen in enumerate(self._gens)]
        started: set[int] = set()
        while len(started) < len(self._gens):
            i, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            started.add(i)
            self._pending.append((i, item))
            if item is None:
                self._num_done += 1

    async def _pump(self, i: int, gen: Any) -> None:
        assert self._queue is not None
        try:
            async for out in gen:
                self._queue.put_nowait((i, out))
            self._queue.put_nowait((i, None))
        except Exception as e:  # handed to the consumer, which raises it
            self._queue.put_nowait((i, e))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs until all have finished; raises what the engine raised."""
        pending, self._pending = self._pending, []
        for i, out in pending:
            if out is not None:
                yield i, out
        if self._queue is None:  # one choice: iterate its generator directly
            if not pending[0][1].finished:
                async for out in self._gens[0]:
                    yield 0, out
            return
        while self._num_done < len(self._gens):
            i, item = await self._queue.get()
            if item is None:
                self._num_done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def aclose(self) -> None:
        """Abort every unfinished engine request (idempotent)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for gen in self._gens:
            with contextlib.suppress(Exception):
                await gen.aclose()


class DisconnectWatch:
    """Cancels the current task when the client disconnects (see module doc)."""

    def __init__(self, receive: Callable[[], Any]) -> None:
        self.disconnected = False
        self._active = True
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._wait(receive))
        self._watch.add_done_callback(self._on_done)

    @staticmethod
    async def _wait(receive: Callable[[], Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    def _on_done(self, fut: asyncio.Future) -> None:
        if not self._active or fut.cancelled() or fut.exception() is not None:
            return
        self.disconnected = True
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        """Stop watching (call before the response completes: uvicorn then reports a
        disconnect to every receive())."""
        self._active = False
        self._watch.cancel()

    def absorb(self) -> bool:
        """In an `except CancelledError`: True (and the task un-cancelled) when the cancellation
        was ours, i.e. the client went away; False when it must propagate."""
        self.close()
        if not self.disconnected:
            return False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True


class SSEResponse(Response):
    """Server-sent events from an async iterator of bytes; closes it and the watch on any exit."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], watch: DisconnectWatch,
                 on_disconnect: Callable[[], None], headers: dict[str, str]) -> None:
        self.events = events
        self.watch = watch
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.watch.close()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self.watch.absorb():
                raise
            self.on_disconnect()
        finally:
            self.watch.close()
            await self.events.aclose()  # type: ignore[attr-defined]
