"""Connection limits (server/process/connections.py) over both uvicorn HTTP implementations: a
small ASGI app behind the limited protocol, served by uvicorn on a uvloop in a background thread
and driven over raw sockets; then the real app's 405 and mid-body disconnect. The deadlines are
short and every wait for the server is generous: the tests check what happens, never how fast."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import h11
import httpx
import pytest
import uvicorn
import uvloop

from moeserve.engine.process.protocol import EngineStats
from moeserve.server.metrics import ServerMetrics
from moeserve.server.process.connections import (
    BODY_TIMED_OUT,
    ConnectionLimits,
    protocol_class,
    resolve_max_connections,
)
from moeserve.server.process.launch import add_serve_args
from tests.server.conftest import LiveServer

DEADLINE_S = 0.2  # both deadlines
CAP = 4
WAIT_S = 30.0  # for anything the server does


class App:
    """POST /echo reads the body and answers its length; GET /stream sends one chunk, then the
    rest once the test releases it. Records what each request's receive() ended with."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.release: asyncio.Event | None = None
        self.ends: list[tuple[str, bool]] = []  # (how the body ended, scope[BODY_TIMED_OUT])

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
            assert self.release is not None
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"last\n"})
            return
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.ends.append(("disconnect", bool(scope.get(BODY_TIMED_OUT))))
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.ends.append(("complete", False))
        body = json.dumps({"length": size}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class LimitedServer:
    """uvicorn with connections.py's protocol over `App`, in a thread with its own uvloop."""

    def __init__(self, http_impl: str) -> None:
        fake_client = SimpleNamespace(stats=EngineStats(), num_in_flight=0, alive=True)
        self.metrics = ServerMetrics(fake_client)  # type: ignore[arg-type]
        self.app = App()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        limits = ConnectionLimits(DEADLINE_S, DEADLINE_S, CAP)
        config = uvicorn.Config(self.app, http=protocol_class(http_impl, limits, self.metrics),
                                lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=600)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_for(lambda: self.server.started)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self._main())

    async def _main(self) -> None:
        self.app.loop = asyncio.get_running_loop()
        self.app.release = asyncio.Event()
        await self.server.serve(sockets=[self.sock])

    def num_open(self) -> int:
        return len(self.server.server_state.connections)

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.01)


class Client:
    """One raw connection, with h11 reading the responses."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.h11 = h11.Connection(h11.CLIENT)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def start(self, method: str, path: str, length: int = 0, body: bytes = b"") -> None:
        """Send a request's headers (Content-Length: length) and `body`, maybe not all of it."""
        headers = [("Host", "test"), ("Content-Length", str(length))]
        self.send(self.h11.send(h11.Request(method=method, target=path, headers=headers)) +
                  body)

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
        self.start(method, path, len(body))
        self.send(self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage()))
        return self.response()

    def response(self) -> tuple[int, dict, bytes]:
        """(status, headers, body) of the next response."""
        status, headers, body = 0, {}, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(self._recv())
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return status, headers, body
            else:
                raise AssertionError(f"unexpected {event!r}")

    def read_some(self) -> bytes:
        return self._recv()

    def wait_closed(self) -> bytes:
        """Whatever arrives until the server closes (a reset counts as closed too)."""
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := self.sock.recv(65536):
                data += chunk
        return data

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(65536)
        except ConnectionResetError:
            return b""

    def close(self) -> None:
        self.sock.close()


def request_bytes(method: str, path: str, body: bytes = b"",
                  length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {length}\r\n\r\n"
            .encode() + body)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[LimitedServer]:
    s = LimitedServer(request.param)
    yield s
    s.stop()


@pytest.fixture()
def clients(server: LimitedServer) -> Iterator[Callable[[], Client]]:
    """New connections, each closed after the test; starts once the server has none open."""
    opened: list[Client] = []
    wait_for(lambda: server.num_open() == 0)

    def connect() -> Client:
        opened.append(Client(server.port))
        return opened[-1]

    yield connect
    for c in opened:
        c.close()


def test_silent_connection_is_closed(server: LimitedServer,
                                     clients: Callable[[], Client]) -> None:
    before = server.count("moeserve_connection_timeouts_total", phase="headers")
    assert clients().wait_closed() == b""
    assert server.count("moeserve_connection_timeouts_total", phase="headers") == before + 1


def test_trickled_headers_are_closed(clients: Callable[[], Client]) -> None:
    c = clients()
    c.send(b"POST /echo HTTP/1.1\r\n")
    c.send(b"Host: test\r\n")
    assert c.wait_closed() == b""


def test_keep_alive_request_headers_are_bounded(clients: Callable[[], Client]) -> None:
    c = clients()
    assert c.request("POST", "/echo", b"abc")[0] == 200
    c.send(b"POST /echo HTTP/1.1\r\nHost: test\r\n")  # the next request's headers stall
    assert c.wait_closed() == b""


def test_idle_keep_alive_is_not_cut(clients: Callable[[], Client]) -> None:
    c = clients()
    assert c.request("POST", "/echo", b"abc")[0] == 200
    assert clients().wait_closed() == b""  # a header deadline has passed since
    status, _, body = c.request("POST", "/echo", b"abcd")
    assert status == 200 and json.loads(body) == {"length": 4}


def test_stalled_body_gets_408(server: LimitedServer, clients: Callable[[], Client]) -> None:
    before = server.count("moeserve_connection_timeouts_total", phase="body")
    seen = len(server.app.ends)  # the module's server: earlier tests' requests ended before
    c = clients()
    c.start("POST", "/echo", 100, b"x" * 10)
    status, headers, body = c.response()
    assert status == 408 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == 408 and error["type"] == "invalid_request_error"
    assert c.wait_closed() == b""
    assert server.count("moeserve_connection_timeouts_total", phase="body") == before + 1
    # the app saw the end, marked ours (an earlier test's request may end after this one's
    # start on a loaded machine: look for ours among the ends since)
    wait_for(lambda: ("disconnect", True) in server.app.ends[seen:])


def test_streaming_response_outlives_the_deadlines(server: LimitedServer,
                                                   clients: Callable[[], Client]) -> None:
    stream = clients()
    stream.start("GET", "/stream")
    assert b"first" in stream.read_some()
    # both deadlines pass (as two other connections show) while the response is in progress
    assert clients().wait_closed() == b""
    late_body = clients()
    late_body.start("POST", "/echo", 10, b"x")
    assert late_body.response()[0] == 408
    assert server.app.loop is not None and server.app.release is not None
    server.app.loop.call_soon_threadsafe(server.app.release.set)
    rest = stream.read_some()
    while not rest.endswith(b"0\r\n\r\n"):  # the chunked response's end
        more = stream.read_some()
        assert more, f"the stream was cut: {rest!r}"
        rest += more
    assert b"last" in rest


def test_cap_refuses_with_503_and_keeps_the_others(server: LimitedServer,
                                                   clients: Callable[[], Client]) -> None:
    before = server.count("moeserve_connections_refused_total")
    held = [clients() for _ in range(CAP)]
    for c in held:
        assert c.request("POST", "/echo", b"a")[0] == 200
    extra = clients()
    status, headers, body = extra.request("POST", "/echo", b"a")  # sent at once, as clients do
    assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable"
    assert extra.wait_closed() == b""
    extra.close()
    assert server.count("moeserve_connections_refused_total") == before + 1
    for c in held:  # the open connections keep working
        assert c.request("POST", "/echo", b"ab")[0] == 200
    held[0].close()
    wait_for(lambda: server.num_open() == CAP - 1)
    assert server.count("moeserve_num_connections") == CAP - 1
    assert clients().request("POST", "/echo", b"a")[0] == 200


def test_deadline_waits_for_bytes_the_loop_has_not_read(server: LimitedServer,
                                                        clients: Callable[[], Client]) -> None:
    """uvloop runs due timers before it reads sockets: a request that arrived while the loop
    was stalled (in a socket's callback) past the deadline is served, not closed."""
    c = clients()
    wait_for(lambda: server.num_open() == 1)  # connected: its header deadline runs
    loop = server.app.loop
    assert loop is not None
    stalled, sent = threading.Event(), threading.Event()
    wake, waker = socket.socketpair()

    def stall() -> None:
        loop.remove_reader(wake)
        stalled.set()
        sent.wait(WAIT_S)
        time.sleep(2 * DEADLINE_S)  # the deadline passes while the request waits unread

    loop.call_soon_threadsafe(loop.add_reader, wake, stall)
    waker.send(b"!")
    assert stalled.wait(WAIT_S)
    c.start("POST", "/echo", 3, b"abc")
    sent.set()
    assert c.response()[0] == 200
    wake.close()
    waker.close()


def test_resolve_max_connections() -> None:
    cap, why = resolve_max_connections(None, 1 << 20, 4352)
    assert cap == (1 << 20) - 256 and "open-files limit" in why
    cap, why = resolve_max_connections(None, 10_000, 4352)  # the limit cannot cover 4 x
    assert cap == 10_000 - 256 and "ulimit -Hn" in why
    cap, _ = resolve_max_connections(None, 256, 10)  # a tiny limit keeps most for sockets
    assert 0 < cap < 256
    cap, why = resolve_max_connections(4, 1 << 20, 4352)
    assert cap == 4 and why.startswith("--max-connections") and "429" in why


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([])
    assert args.max_connections is None  # auto
    assert args.http_header_timeout > 0 and args.http_body_timeout > 0
    args = parser.parse_args(["--max-connections", "8", "--http-header-timeout", "0.5"])
    assert args.max_connections == 8 and args.http_header_timeout == 0.5
    for bad in (["--max-connections", "0"], ["--http-body-timeout", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


# -- the real app (conftest's live server: uvicorn's own protocol) ---------------------------

def test_405_carries_allow(http: httpx.Client) -> None:
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405


@contextlib.contextmanager
def error_records() -> Iterator[list[logging.LogRecord]]:
    """Records at ERROR or above from uvicorn (which does not propagate) and moeserve."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "moeserve")]
    for log in loggers:
        log.addHandler(handler)
    try:
        yield records
    finally:
        for log in loggers:
            log.removeHandler(handler)


def test_mid_body_disconnect_is_quiet(live: LiveServer, http: httpx.Client) -> None:
    def disconnects() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("moeserve_client_disconnects_total "):
                return float(line.split()[1])
        raise AssertionError("no disconnect counter")

    before = disconnects()
    port = int(live.url.rsplit(":", 1)[1])
    with error_records() as errors:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(request_bytes("POST", "/v1/completions", b'{"prompt": ', length=500))
        wait_for(lambda: bool(errors) or disconnects() == before + 1)
    assert not errors, [r.getMessage() for r in errors]
    assert disconnects() == before + 1
