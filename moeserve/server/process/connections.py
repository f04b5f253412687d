"""Connection limits of the HTTP server: deadlines for receiving a request, and a cap on the
open connections of one API process.

uvicorn bounds neither: its keep-alive timeout runs only after a response, and its
`limit_concurrency` counts a connection only once its headers are complete, so a client that
connects and trickles (or never sends) its headers holds a socket forever. This module owns both
limits, in a subclass of uvicorn's HTTP protocol (httptools or h11: `protocol_class` builds one
over either), and the resolution of the cap from the open-files limit (`resolve_max_connections`).

One connection, phase by phase:

    event                              phase     deadline armed
    connection_made (over the cap?)    -         503 + Retry-After: 1, close       (refused)
    connection_made                    HEADERS   header_timeout
    first byte of a keep-alive request HEADERS   header_timeout
    headers complete                   BODY      body_timeout (from the headers)
    body complete                      IDLE      none: the response, however long it streams,
                                                 is not bounded; after it uvicorn's keep-alive

    header deadline passes  -> the connection is closed (there is no request to answer)
    body deadline passes    -> 408 (OpenAI-style JSON, Connection: close); the app's receive()
                               reports a disconnect and the scope carries BODY_TIMED_OUT

A deadline is the client's fault only: when it fires while the kernel still holds bytes the
event loop has not read (uvloop runs due timers before it polls sockets, so a loop that stalled
sees its timers first) it is checked again after the next poll, for at most one more deadline
from that first firing; while uvicorn has paused reading (the app has not consumed the body
yet) it starts again. A deadline never closes a response in progress: a pipelined request
that is late behind one ends the connection once that response is complete.

A refused or timed-out connection closes lingeringly: the response, then our FIN, then whatever
the client still sends is read and dropped until it closes (or `_LINGER_S`), so its request in
flight does not turn our close into a reset that loses the response.
"""

from __future__ import annotations

import asyncio
import http
import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
import msgspec

from moeserve.server.errors import APIError

if TYPE_CHECKING:
    from moeserve.server.metrics import ServerMetrics

logger = logging.getLogger("moeserve.server")
BODY_TIMED_OUT = "moeserve.body_timed_out"  # scope key: the 408 is sent, the disconnect is ours
FILE_RESERVE = 256  # files kept for the process's own use: ZMQ sockets, logs, the tokenizer...
QUEUE_FACTOR = 4  # the cap covers this many times the queue bound, so overload gets 429s
HEADERS, BODY, IDLE = "headers", "body", "idle"
_GRACE_S = 0.01  # re-check of a deadline that passed with unread bytes in the kernel
_LINGER_S = 2.0  # at most this long reading and dropping input after a refusal or a 408
_REFUSAL_LOG_S = 10.0  # at most one warning about refusals per this many seconds


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one API process allows a connection."""

    header_timeout: float  # seconds from connect (or a keep-alive request's first byte) to headers
    body_timeout: float  # seconds from the headers to the end of the body
    max_connections: int  # open connections; the next one gets 503 at accept

    def __post_init__(self) -> None:
        if not (self.header_timeout > 0 and self.body_timeout > 0):
            raise ValueError("the header and body timeouts must be > 0 seconds")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")


def resolve_max_connections(requested: int | None, open_files: int,
                            queue_bound: int) -> tuple[int, str]:
    """The connection cap of one API process and the reason for it.

    Args:
        requested: --max-connections, or None for "auto".
        open_files: the process's soft RLIMIT_NOFILE (already raised to the hard limit).
        queue_bound: requests this process admits before 429 (max running + max waiting).
    Returns:
        (cap, reason). Auto: the open-files limit less a reserve for the process's own files,
        which is >= QUEUE_FACTOR x queue_bound whenever the limit allows it.
    """
    reserve = min(FILE_RESERVE, open_files // 4)
    room = open_files - reserve
    want = QUEUE_FACTOR * queue_bound
    if requested is not None:
        notes = []
        if requested > room:
            notes.append(f"above the open-files limit {open_files} less {reserve} reserved: "
                         f"accepts past {room} may fail")
        if requested < want:
            notes.append(f"below {QUEUE_FACTOR} x the queue bound {queue_bound} = {want}: an "
                         f"overload is refused connections before it gets 429s")
        return requested, "; ".join(["--max-connections", *notes])
    why = f"the open-files limit {open_files} less {reserve} reserved for the process's own files"
    if room >= want:
        return room, f"{why} (>= {QUEUE_FACTOR} x the queue bound {queue_bound})"
    return room, (f"{why}; below {QUEUE_FACTOR} x the queue bound {queue_bound} = {want}, so an "
                  f"overload is refused connections before it gets 429s: raise the hard "
                  f"open-files limit (ulimit -Hn) to at least {want + reserve}")


def protocol_class(http_impl: str, limits: ConnectionLimits,
                   metrics: ServerMetrics) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ("httptools" or "h11") with the limits; pass it as
    uvicorn.Config(http=...). `metrics` counts refusals and timeouts."""
    if http_impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        bases: tuple[type, ...] = (_HttptoolsPhases, _Guard, HttpToolsProtocol)
    elif http_impl == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        bases = (_H11Phases, _Guard, H11Protocol)
    else:
        raise ValueError(f"unknown HTTP implementation {http_impl!r}")
    attrs = {"limits": limits, "metrics": metrics, "refusals": _RefusalLog()}
    return type(f"Limited{bases[-1].__name__}", bases, attrs)


class _RefusalLog:
    """Refusals come in floods: one warning per _REFUSAL_LOG_S with the count since."""

    def __init__(self) -> None:
        self.num_unlogged = 0
        self.last = -_REFUSAL_LOG_S

    def add(self, num_open: int, cap: int) -> None:
        self.num_unlogged += 1
        now = time.monotonic()
        if now - self.last >= _REFUSAL_LOG_S:
            logger.warning("refused %d connection(s) with 503: %d open, the cap is %d "
                           "(--max-connections)", self.num_unlogged, num_open - 1, cap)
            self.num_unlogged, self.last = 0, now


class _Guard:
    """The limits, over either uvicorn protocol (which supplies transport, flow, cycle,
    connections, server_state, loop). A phase class supplies `_received_phase()`: what the
    parser has seen so far."""

    limits: ConnectionLimits
    metrics: ServerMetrics
    refusals: _RefusalLog
    _phase = IDLE
    _timer: asyncio.TimerHandle | None = None
    _deadline_at = 0.0
    _late_since = 0.0  # when the deadline first fired (0: not yet)
    _dropping = False  # refused, answered 408 or ending after a response: input is dropped
    _close_after_response = False
    transport: Any
    flow: Any
    cycle: Any
    connections: set
    server_state: Any
    loop: asyncio.AbstractEventLoop
    _received_phase: Callable[[], str]  # the phase class's (httptools or h11 below)

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self.metrics.num_connections.set(len(self.connections))
        if len(self.connections) > self.limits.max_connections:
            self.metrics.connections_refused.inc()
            self.refusals.add(len(self.connections), self.limits.max_connections)
            self._answer_and_close(503, f"too many open connections (the limit is "
                                   f"{self.limits.max_connections}); retry later",
                                   [(b"retry-after", b"1")])
            return
        self._enter(HEADERS)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        super().data_received(data)  # type: ignore[misc]
        self._sync()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)  # type: ignore[misc]
        self.metrics.num_connections.set(len(self.connections))

    def on_response_complete(self) -> None:
        if self._close_after_response:
            self.transport.close()
        super().on_response_complete()  # type: ignore[misc]
        self._sync()  # h11 parses a pipelined request only now

    # -- phases and deadlines -----------------------------------------------------------------
    def _sync(self) -> None:
        phase = self._received_phase()
        if phase != self._phase and not self._dropping:
            self._enter(phase)

    def _enter(self, phase: str) -> None:
        self._phase = phase
        self._late_since = 0.0
        self._cancel_timer()
        if phase != IDLE:
            self._deadline_at = self.loop.time() + self._timeout(phase)
            self._timer = self.loop.call_at(self._deadline_at, self._on_deadline)

    def _timeout(self, phase: str) -> float:
        return self.limits.header_timeout if phase == HEADERS else self.limits.body_timeout

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_deadline(self) -> None:
        self._timer = None
        if self._dropping or self.transport.is_closing() or \
                self.transport.get_protocol() is not self:  # closed, or upgraded away
            return
        if self.flow.read_paused:  # uvicorn stopped reading (the app is behind): not late
            self._enter(self._phase)
            return
        now = self.loop.time()
        self._late_since = self._late_since or now
        if now < self._late_since + self._timeout(self._phase) and \
                _has_unread_bytes(self.transport):  # the loop is behind, not the client
            self._timer = self.loop.call_later(_GRACE_S, self._on_deadline)
            return
        self.metrics.connection_timeouts.labels(self._phase).inc()
        if self._phase == HEADERS:
            self._headers_late()
        else:
            self._body_late()

    def _headers_late(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self._end_after_response()  # a pipelined request behind a response in progress
            return
        logger.debug("%s: no complete request headers within %g s: closing",
                     _peer(self.transport), self.limits.header_timeout)
        self.transport.close()

    def _body_late(self) -> None:
        cycle = self.cycle
        if getattr(self, "pipeline", None) or (cycle.response_started and
                                               not cycle.response_complete):
            self._end_after_response()  # queued behind a response (httptools), or answering
            return
        if cycle.response_complete:  # answered without reading the body, which stalls
            self.transport.close()
            return
        logger.info("%s %s %s: 408, the body did not arrive within %g s of its headers",
                    _peer(self.transport), cycle.scope["method"], cycle.scope["path"],
                    self.limits.body_timeout)
        cycle.scope[BODY_TIMED_OUT] = True
        cycle.disconnected = True  # the app's receive() answers http.disconnect, send() no-ops
        cycle.message_event.set()
        self._answer_and_close(408, f"the request body did not arrive within "
                               f"{self.limits.body_timeout:g} s of its headers", [])

    def _end_after_response(self) -> None:
        self._dropping = self._close_after_response = True
        self._cancel_timer()

    # -- closing --------------------------------------------------------------------------------
    def _answer_and_close(self, status: int, message: str,
                          headers: list[tuple[bytes, bytes]]) -> None:
        """A minimal response written straight to the transport, then a lingering close."""
        body = msgspec.json.encode(APIError(status, message).to_dict())
        lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
        lines += [name + b": " + value for name, value in self.server_state.default_headers]
        lines += [name + b": " + value for name, value in headers]
        lines += [b"content-type: application/json", b"content-length: %d" % len(body),
                  b"connection: close", b"", body]
        self.transport.write(b"\r\n".join(lines))
        self._dropping = True
        self._cancel_timer()
        self.flow.resume_reading()  # read (and drop) until the client closes: no reset
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(_LINGER_S, self.transport.close)


class _HttptoolsPhases:
    """httptools reports the parse through callbacks: follow them."""

    _parsed = HEADERS

    def _received_phase(self) -> str:
        return self._parsed

    def on_message_begin(self) -> None:
        self._parsed = HEADERS
        super().on_message_begin()  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        self._parsed = BODY

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        self._parsed = IDLE


class _H11Phases:
    """h11 keeps the client's side of the exchange as a state: read it."""

    conn: Any
    _phase: str

    def _received_phase(self) -> str:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return BODY
        if state is h11.IDLE and (self._phase == HEADERS or self.conn.trailing_data[0]):
            return HEADERS  # a fresh connection, or part of a keep-alive request's headers
        return IDLE


def _has_unread_bytes(transport: asyncio.Transport) -> bool:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


def _peer(transport: asyncio.Transport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"
