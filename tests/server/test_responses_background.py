"""Background responses (`background: true`): the store's in-flight rows (written only while in
flight, never evicted, failed when another server left them), the route over an engine whose
outputs the test releases one by one (queued -> in_progress -> completed; cancel, from this API
process and from another sharing the store; a failed engine request; shutdown), and the live
tiny-moe server through the openai SDK."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from moeserve.engine.process.async_client import RequestFailedError
from moeserve.server.app import build_app, shutdown_engine
from moeserve.server.responses.background import SHUT_DOWN
from moeserve.server.responses.protocol import ResponseObject
from moeserve.server.responses.store import LEFT_BEHIND, ResponseStore
from moeserve.tokenizer import ByteTokenizer
from moeserve.types import FinishReason, RequestOutput, SamplingParams
from tests.server.conftest import LiveServer

RESPONSES = "/v1/responses"


def _row(response_id: str, status: str) -> dict[str, Any]:
    return {"id": response_id, "status": status, "output": [], "background": True}


# ---- the store ---------------------------------------------------------------------------


def test_in_flight_rows_are_updated_until_they_end_and_never_evicted() -> None:
    store = ResponseStore(max_responses=1)
    store.add(_row("a", "queued"), [])
    assert store.update(_row("a", "in_progress"), [])
    store.add(_row("b", "completed"), [])  # over max_responses: "a" stays, in flight
    assert store.statuses(["a", "b", "c"]) == {"a": "in_progress", "b": "completed"}
    ended = store.end("a", "cancelled")
    assert ended is not None and ended["status"] == "cancelled" and ended["error"] is None
    assert not store.update(_row("a", "completed"), [])  # a task late after the cancel
    stored = store.get("a")
    assert stored is not None and stored.body["status"] == "cancelled"
    again = store.end("a", "failed", {"code": "server_error", "message": "x"})
    assert again is not None and again["status"] == "cancelled"  # ended stays ended
    assert store.end("none", "cancelled") is None
    store.add(_row("c", "completed"), [])  # now "a" may go
    assert store.statuses(["a", "b", "c"]) == {"c": "completed"}


def test_rows_another_server_left_in_flight_fail_when_the_store_opens(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite")
    first = ResponseStore(path, owner="server-1")
    first.add(_row("a", "in_progress"), [])
    first.add(_row("b", "completed"), [])
    same = ResponseStore(path, owner="server-1")  # another API process of the same server
    assert same.statuses(["a", "b"]) == {"a": "in_progress", "b": "completed"}
    ResponseStore(path, owner="server-2")  # a restart
    stored = first.get("a")
    assert stored is not None and stored.body["status"] == "failed"
    assert stored.body["error"] == LEFT_BEHIND
    assert first.statuses(["b"]) == {"b": "completed"}


def test_a_store_file_of_format_1_is_brought_up(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite")
    with sqlite3.connect(path) as db:  # session 35's format
        db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, body BLOB NOT NULL, items BLOB "
                   "NOT NULL, num_input INTEGER NOT NULL, size INTEGER NOT NULL, used INTEGER "
                   "NOT NULL)")
        db.execute("PRAGMA user_version = 1")
    old = ResponseStore(path, owner="old")
    old.close()
    with sqlite3.connect(path) as db:
        [(version,)] = db.execute("PRAGMA user_version").fetchall()
        columns = [row[1] for row in db.execute("PRAGMA table_info(responses)")]
    assert version == 2 and columns[-3:] == ["status", "owner", "streamed"]
    store = ResponseStore(path)
    store.add(_row("a", "completed"), [])
    assert store.statuses(["a"]) == {"a": "completed"}


# ---- the route, over an engine the test steps ----------------------------------------------


class SteppedEngine:
    """An engine client whose requests yield one output each time the test releases one;
    `closed` names the requests whose generator was closed unfinished (aborted)."""

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer(512, None, None)
        self.model_name = self.model = "stepped"
        self.model_config = types.SimpleNamespace(architecture="Test", vocab_size=512)
        self.sampling_defaults: dict = {}
        self.max_model_len = 1024
        self.ready = self.alive = True
        self.num_in_flight = 0
        self.stats = None
        self.releases: asyncio.Queue[str | BaseException] = asyncio.Queue()
        self.started: list[str] = []
        self.closed: list[str] = []

    async def generate(self, request_id: str, prompt: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.started.append(request_id)
        finished = False
        try:
            while not finished:
                step = await self.releases.get()
                if isinstance(step, BaseException):
                    raise step
                finished = step.endswith("$")
                text = step.rstrip("$")
                yield RequestOutput(request_id, prompt, list(text.encode()), finished=finished,
                                    finish_reason=FinishReason.STOP if finished else None,
                                    text=text)
        finally:
            if not finished:
                self.closed.append(request_id)

    async def shutdown(self) -> None:
        pass


async def _until(check: Any, what: str) -> None:
    """Yield to the app's tasks until `check()` holds (or fail naming `what`)."""
    for _ in range(2000):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def _app(engine: SteppedEngine, store: ResponseStore | None = None) -> Any:
    app = build_app(engine, None, responses=store)  # type: ignore[arg-type]
    app.state.ctx.background.poll_seconds = app.state.ctx.background.tail_poll_seconds = 0.01
    return app


def _http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def _status(http: httpx.AsyncClient, response_id: str) -> str:
    r = await http.get(f"{RESPONSES}/{response_id}")
    assert r.status_code == 200, r.text
    ResponseObject.model_validate(r.json())
    return str(r.json()["status"])


async def _wait_status(http: httpx.AsyncClient, response_id: str, status: str) -> None:
    for _ in range(2000):
        if await _status(http, response_id) == status:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{response_id} never {status}")


async def _create(http: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    r = await http.post(RESPONSES, json={"input": "Hi", "background": True, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    ResponseObject.model_validate(body)
    return dict(body)


def test_a_background_response_goes_queued_in_progress_completed() -> None:
    async def main() -> None:
        engine = SteppedEngine()
        async with _http(_app(engine)) as http:
            body = await _create(http)
            assert body["status"] == "queued" and body["background"] is True
            assert body["output"] == [] and body["usage"] is None
            rid = body["id"]
            assert (await http.post(RESPONSES, json={
                "input": "x", "previous_response_id": rid})).json()["error"]["param"] == \
                "previous_response_id"  # not while it runs
            engine.releases.put_nowait("Hel")
            await _wait_status(http, rid, "in_progress")
            engine.releases.put_nowait("lo$")
            await _wait_status(http, rid, "completed")
            final = (await http.get(f"{RESPONSES}/{rid}")).json()
            assert final["status"] == "completed" and final["usage"]["output_tokens"] == 5
            assert final["output"][0]["content"][0]["text"] == "Hello"
            items = (await http.get(f"{RESPONSES}/{rid}/input_items")).json()["data"]
            assert [i["type"] for i in items] == ["message"]
            r = await http.post(f"{RESPONSES}/{rid}/cancel")  # it has ended
            assert r.status_code == 400 and "completed" in r.json()["error"]["message"]
            engine.releases.put_nowait("ok$")  # a follow-up, now allowed
            r = await http.post(RESPONSES, json={"input": "x", "previous_response_id": rid})
            assert r.status_code == 200 and r.json()["status"] == "completed"
            assert engine.closed == []

    asyncio.run(main())


def test_cancel_ends_it_and_aborts_the_engine_request() -> None:
    async def main() -> None:
        engine = SteppedEngine()
        async with _http(_app(engine)) as http:
            rid = (await _create(http))["id"]
            engine.releases.put_nowait("a")
            await _wait_status(http, rid, "in_progress")
            r = await http.post(f"{RESPONSES}/{rid}/cancel")
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            ResponseObject.model_validate(r.json())
            await _until(lambda: engine.closed == [rid], "the engine request aborted")
            assert await _status(http, rid) == "cancelled"
            again = await http.post(f"{RESPONSES}/{rid}/cancel")  # idempotent
            assert again.status_code == 200 and again.json()["status"] == "cancelled"
            # a queued one (its engine request waits for its first output), then DELETE of a
            # running one
            queued = (await _create(http))["id"]
            await _until(lambda: queued in engine.started, "submitted")
            assert (await http.post(f"{RESPONSES}/{queued}/cancel")).json()["status"] == \
                "cancelled"
            running = (await _create(http))["id"]
            engine.releases.put_nowait("b")
            await _wait_status(http, running, "in_progress")
            assert (await http.delete(f"{RESPONSES}/{running}")).status_code == 200
            await _until(lambda: engine.closed == [rid, queued, running], "all aborted")
            # not a background one; not one at all; a stream asked of GET
            engine.releases.put_nowait("x$")
            fore = (await http.post(RESPONSES, json={"input": "Hi"})).json()["id"]
            r = await http.post(f"{RESPONSES}/{fore}/cancel")
            assert r.status_code == 400 and "background" in r.json()["error"]["message"]
            assert (await http.post(f"{RESPONSES}/none/cancel")).status_code == 404
            r = await http.get(f"{RESPONSES}/{fore}", params={"stream": "true"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream"

    asyncio.run(main())


def _two_api_processes(tmp_path: Path) -> tuple[SteppedEngine, Any, Any]:
    """One engine and two apps on one store file of one server (as --api-servers 2)."""
    path = str(tmp_path / "r.sqlite")
    engine = SteppedEngine()
    return (engine, _app(engine, ResponseStore(path, owner="s")),
            _app(engine, ResponseStore(path, owner="s")))


def test_a_cancel_through_another_api_process_reaches_the_one_running_it(tmp_path: Path) -> None:
    """Two apps on one store file (as --api-servers 2): the cancel lands on the other; the
    runner's watcher sees the row ended and aborts its engine request."""
    async def main() -> None:
        engine, runner, other = _two_api_processes(tmp_path)
        async with _http(runner) as one, _http(other) as two:
            rid = (await _create(one))["id"]
            await _until(lambda: rid in engine.started, "submitted")
            r = await two.post(f"{RESPONSES}/{rid}/cancel")
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            await _until(lambda: engine.closed == [rid], "the runner aborted it")
            assert await _status(one, rid) == "cancelled"
            deleted = (await _create(one))["id"]  # a DELETE through the other, the same way
            await _until(lambda: deleted in engine.started, "submitted")
            assert (await two.delete(f"{RESPONSES}/{deleted}")).status_code == 200
            await _until(lambda: engine.closed == [rid, deleted], "the runner aborted it")

    asyncio.run(main())


def test_an_engine_failure_fails_the_response_and_shutdown_fails_the_running() -> None:
    async def main() -> None:
        engine = SteppedEngine()
        app = _app(engine)
        async with _http(app) as http:
            failing = (await _create(http))["id"]
            engine.releases.put_nowait(RequestFailedError("the step failed"))
            await _wait_status(http, failing, "failed")
            body = (await http.get(f"{RESPONSES}/{failing}")).json()
            assert body["status"] == "failed" and body["error"]["code"] == "server_error"
            assert "the step failed" in body["error"]["message"]
            running = (await _create(http))["id"]
            engine.releases.put_nowait("a")
            await _wait_status(http, running, "in_progress")
            await shutdown_engine(app)
            body = (await http.get(f"{RESPONSES}/{running}")).json()
            assert body["status"] == "failed" and body["error"] == SHUT_DOWN
            assert engine.closed == [failing, running]  # the failed one ended unfinished too

    asyncio.run(main())


# ---- the live server (tiny-moe) -------------------------------------------------------------


def test_the_sdk_polls_a_background_response_to_the_foreground_reply(
        long_live: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{long_live.url}/v1", api_key="unused", max_retries=0)
    kwargs: dict[str, Any] = {"model": "tiny-moe", "input": "Hi", "max_output_tokens": 8,
                              "temperature": 0}
    started = client.responses.create(background=True, **kwargs)
    assert started.status in ("queued", "in_progress") and started.background
    deadline = time.monotonic() + 60
    polled = client.responses.retrieve(started.id)
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        polled = client.responses.retrieve(started.id)
    foreground = client.responses.create(**kwargs)
    assert polled.status == foreground.status and polled.output_text == foreground.output_text
    with pytest.raises(openai.BadRequestError, match="already ended"):
        client.responses.cancel(started.id)


# ---- streamed background responses ---------------------------------------------------------


def _events(body: bytes) -> list[dict[str, Any]]:
    """The SSE frames' data, each frame's `event:` checked against its type."""
    out = []
    for frame in body.decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_a_streamed_background_response_is_kept_and_resumed_from_any_event() -> None:
    async def main() -> None:
        engine = SteppedEngine()
        async with _http(_app(engine)) as http:
            for step in ("Hel", "lo", " there$"):
                engine.releases.put_nowait(step)
            r = await http.post(RESPONSES, json={"input": "Hi", "background": True,
                                                 "stream": True})
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream")
            events = _events(r.content)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[0]["type"] == "response.created"
            assert events[-1]["type"] == "response.completed"
            rid = events[-1]["response"]["id"]
            assert events[-1]["response"]["background"] is True
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == "Hello there"
            stored = (await http.get(f"{RESPONSES}/{rid}")).json()
            assert stored["status"] == "completed" and stored == events[-1]["response"]
            resumed = await http.get(f"{RESPONSES}/{rid}",
                                     params={"stream": "true", "starting_after": 2})
            assert _events(resumed.content) == events[3:]
            everything = await http.get(f"{RESPONSES}/{rid}", params={"stream": "true"})
            assert _events(everything.content) == events
            for params, param in (({"stream": "yes"}, "stream"),
                                  ({"stream": "true", "starting_after": "x"}, "starting_after"),
                                  ({"after": 1}, "after")):
                bad = await http.get(f"{RESPONSES}/{rid}", params=params)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param
            engine.releases.put_nowait("x$")  # not streamed: no events kept
            plain = (await _create(http))["id"]
            await _wait_status(http, plain, "completed")
            bad = await http.get(f"{RESPONSES}/{plain}", params={"stream": "true"})
            assert bad.status_code == 400 and "not created with" in bad.json()["error"]["message"]

    asyncio.run(main())


async def _running_stream(engine: SteppedEngine, poster: httpx.AsyncClient,
                          reader: httpx.AsyncClient) -> tuple[asyncio.Task, str]:
    """A streamed background POST through `poster` (its task, reading the stream) whose first
    output ("a") is out: "in_progress" as `reader` reads it; and its id."""
    engine.releases.put_nowait("a")
    post = asyncio.create_task(poster.post(RESPONSES, json={
        "input": "Hi", "background": True, "stream": True}))
    await _until(lambda: len(engine.started) == 1, "submitted")
    rid = engine.started[0]
    await _wait_status(reader, rid, "in_progress")
    return post, rid


def test_a_tail_follows_the_events_as_they_come_and_ends_with_a_cancel() -> None:
    """A GET stream opened while the response runs gets what was kept, then each new event,
    and ends when the response is cancelled (its engine request aborted)."""
    async def main() -> None:
        engine = SteppedEngine()
        async with _http(_app(engine)) as http:
            post, rid = await _running_stream(engine, http, http)
            tail = asyncio.create_task(http.get(f"{RESPONSES}/{rid}",
                                                params={"stream": "true"}))
            engine.releases.put_nowait("b")
            await asyncio.sleep(0.05)
            assert not tail.done()  # still running: the tail waits for more
            assert (await http.post(f"{RESPONSES}/{rid}/cancel")).status_code == 200
            got, posted = _events((await tail).content), _events((await post).content)
            assert got == posted and got[0]["type"] == "response.created"
            deltas = [e["delta"] for e in got if e["type"] == "response.output_text.delta"]
            assert "".join(deltas) == "ab" and got[-1]["type"] == "response.output_text.delta"
            await _until(lambda: engine.closed == [rid], "aborted")
            assert await _status(http, rid) == "cancelled"

    asyncio.run(main())


def test_an_engine_failure_ends_the_stream_with_an_error_and_the_response_failed() -> None:
    async def main() -> None:
        engine = SteppedEngine()
        async with _http(_app(engine)) as http:
            engine.releases.put_nowait("a")
            engine.releases.put_nowait(RequestFailedError("the step failed"))
            r = await http.post(RESPONSES, json={"input": "Hi", "background": True,
                                                 "stream": True})
            events = _events(r.content)
            assert events[-1]["type"] == "error" and "the step failed" in events[-1]["message"]
            rid = events[0]["response"]["id"]
            body = (await http.get(f"{RESPONSES}/{rid}")).json()
            assert body["status"] == "failed" and "the step failed" in body["error"]["message"]

    asyncio.run(main())


def test_the_sdk_streams_a_background_response_and_resumes_it(long_live: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{long_live.url}/v1", api_key="unused", max_retries=0)
    events = list(client.responses.create(model="tiny-moe", input="Hi", max_output_tokens=8,
                                          temperature=0, background=True, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    rid = events[-1].response.id
    resumed = list(client.responses.retrieve(rid, stream=True, starting_after=1))
    assert [e.sequence_number for e in resumed] == [e.sequence_number for e in events[2:]]
    assert resumed[-1].response.output_text == events[-1].response.output_text


def test_another_api_process_tails_the_stream_from_the_store(tmp_path: Path) -> None:
    """Two apps on one store file: a stream opened through the one that does not run the
    response polls the kept events and ends with the response."""
    async def main() -> None:
        engine, runner, other = _two_api_processes(tmp_path)
        async with _http(runner) as one, _http(other) as two:
            post, rid = await _running_stream(engine, one, two)
            tail = asyncio.create_task(two.get(f"{RESPONSES}/{rid}",
                                               params={"stream": "true", "starting_after": 0}))
            engine.releases.put_nowait("b$")
            posted, got = _events((await post).content), _events((await tail).content)
            assert got == posted[1:] and got[-1]["type"] == "response.completed"

    asyncio.run(main())
