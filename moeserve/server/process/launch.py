"""`moeserve serve`: its flags, and the start-up and shutdown of the API server process.

    run_serve(args)
      -> bind the port; AsyncEngineClient.launch(engine args): spawns the engine process
      -> uvicorn (uvloop, httptools when installed else h11, no access log, a deep listen
         backlog and the open-files limit raised, for thousands of streams) serving build_app
         at once, with connections.py's protocol (request deadlines, a cap on open
         connections): /health answers 200 during the engine's start-up (weights, MoE tune,
         graphs), /ready and the /v1 routes 503 until the engine is ready
      -> Ready: print the capacity report; watch the engine process
    SIGINT / SIGTERM
      -> the engine client shuts down first: in-flight requests end with an error (503, or an
         error event in a stream) instead of holding the graceful shutdown open
      -> uvicorn closes the listeners and connections, the app's lifespan ends; exit code 0
    the engine process dies
      -> every in-flight request ends with an error (an error event in a stream), then the
         server shuts down and exits with EXIT_ENGINE_DIED, for its supervisor to restart it
    exit codes: 0 stopped by a signal; 1 could not start (port in use, engine start-up
    failed); EXIT_ENGINE_DIED (3) the engine (or, with --api-servers, any serving process) died

The engine client and uvicorn run on one uvloop event loop that this module creates, so the
client's sockets and the HTTP handlers share it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import resource
import signal
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moeserve.engine.args import add_engine_args, engine_kwargs_from_args
from moeserve.gc_tuning import freeze_heap
from moeserve.server.agent.choice import REASONING_PARSER_CHOICES, TOOL_PARSER_CHOICES

if TYPE_CHECKING:  # imported when serving, so that building the CLI parser stays light
    from fastapi import FastAPI

    from moeserve.server.process.connections import ConnectionLimits

logger = logging.getLogger("moeserve.server")
_BACKLOG = 16384  # pending connections: a 2,048-stream benchmark opens them all at once
EXIT_ENGINE_DIED = 3
_DRAIN_SECONDS = 5.0  # after the engine's death: how long streams may take to get their error


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, then every engine flag (which include --model)."""
    parser.add_argument("--preset", dest="model", default=None,
                        help="a built-in preset (same as --model NAME)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: "
                        "127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                        "on every /v1 route (/health, /ready, /metrics stay open)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients "
                        "see in /v1/models and may send as 'model' (default: --model)")
    parser.add_argument("--max-waiting-requests", type=int, default=4096, help="requests "
                        "that may wait beyond max_running_requests; more get HTTP 429 "
                        "(default: 4096)")
    parser.add_argument("--api-servers", type=int, default=1, help="API server processes "
                        "sharing the port in front of the one engine; more than 1 when one "
                        "process cannot carry the streams (default: 1)")
    parser.add_argument("--http-header-timeout", type=_positive_seconds, default=20.0,
                        metavar="SECONDS", help="a connection must send complete request "
                        "headers within this time of connecting (or of a keep-alive request's "
                        "first byte), else it is closed (default: 20)")
    parser.add_argument("--http-body-timeout", type=_positive_seconds, default=60.0,
                        metavar="SECONDS", help="a request must send its whole body within this "
                        "time of its headers, else it gets HTTP 408 and the connection is "
                        "closed; responses are not bounded (default: 60)")
    parser.add_argument("--max-connections", type=_max_connections, default="auto",
                        metavar="N|auto", help="open connections per API process; one more gets "
                        "HTTP 503 with Retry-After: 1 at accept. auto: the open-files limit less "
                        "a reserve for the process's own files, which is at least 4 x (max "
                        "running + max waiting requests) where the limit allows (default: auto)")
    parser.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                        metavar="NAME|auto|none", help="the format of the tool calls chat "
                        "replies are parsed for when a request offers tools (vLLM's and "
                        "SGLang's names: hermes, glm45, glm47, deepseek_v3, deepseek_v31, "
                        "deepseek_v32, kimi_k2, mistral). auto: the format the model's chat "
                        "template writes, or its family's without one (default: auto)")
    parser.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSER_CHOICES,
                        metavar="NAME|auto|none", help="separate a chat reply's <think> "
                        "reasoning into reasoning_content (qwen3, deepseek_r1, glm45, kimi_k2, "
                        "... all read <think>...</think>). auto: on when the chat template "
                        "writes <think>, or, without a template, for reasoning families "
                        "(default: auto)")
    parser.add_argument("--responses-store", default=None, metavar="PATH",
                        help="an SQLite file that keeps the Responses API's stored responses "
                        "(previous_response_id, GET /v1/responses/{id}) across restarts "
                        "(default: none: in memory, or with --api-servers N a file all N share "
                        "for the server's lifetime)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="log level of the server (debug logs every request)")
    add_engine_args(parser)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _max_connections(text: str) -> int | None:
    """"auto" -> None (resolved at start-up from the open-files limit), else an int >= 1."""
    if text == "auto":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'auto', got {text}")
    return value


def raise_open_files_limit() -> int:
    """One socket per client: thousands of streams need more than the usual 1,024 files.
    Raises the soft RLIMIT_NOFILE to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-files limit from %d: %s", soft, e)
    return target if soft == resource.RLIM_INFINITY else soft


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket (uvicorn listens on it with its backlog). With `reuse_port`,
    several API processes bind the same port and the kernel spreads connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def http_implementation() -> str:
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def run_serve(args: argparse.Namespace, join: EngineJoin | None = None) -> int:
    """Start the engine and serve HTTP until SIGINT/SIGTERM. Returns the exit code.

    With --api-servers N > 1 this process becomes the launcher of N API processes
    (process/multiproc.py), each of which calls run_serve again with `join` set."""
    if join is None:
        from moeserve.engine.args import engine_config_from_kwargs
        from moeserve.parallel.node import run_node, serve_role

        cfg = engine_config_from_kwargs(**engine_kwargs_from_args(args))
        if serve_role(cfg) != "engine":  # a worker node: no API server, no engine core
            logging.basicConfig(level=args.log_level.upper())
            return run_node(cfg)
    if join is None and args.api_servers > 1:
        from moeserve.server.process.multiproc import run_launcher

        return run_launcher(args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(args, join))
    except KeyboardInterrupt:  # interrupted during start-up
        return 130


@dataclass(frozen=True, slots=True)
class EngineJoin:
    """How an API process of several joins the engine the launcher started."""

    ipc_dir: str
    client_index: int
    engine_pid: int


async def _serve(args: argparse.Namespace, join: EngineJoin | None) -> int:
    import uvicorn

    from moeserve.engine.process.async_client import AsyncEngineClient
    from moeserve.server.app import build_app, shutdown_engine
    from moeserve.server.process.connections import protocol_class
    from moeserve.server.responses.store import ResponseStore

    try:  # bind first: a port in use fails now, not after minutes of engine start-up
        sock = bind_socket(args.host, args.port, reuse_port=join is not None)
    except OSError as e:
        logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
        return 1
    try:  # the same for the Responses API's store
        responses = ResponseStore(args.responses_store or (
            os.path.join(join.ipc_dir, "responses.sqlite") if join is not None else ":memory:"),
            owner=join.ipc_dir if join is not None else None)  # one owner: the server's
    except ValueError as e:
        sock.close()
        logger.error("--responses-store: %s", e)
        return 1
    common = {"max_waiting_requests": args.max_waiting_requests,
              "served_model_name": args.served_model_name}
    try:
        if join is None:
            client = AsyncEngineClient.launch(engine_kwargs_from_args(args), **common)
        else:
            client = AsyncEngineClient.join(engine_kwargs_from_args(args), join.ipc_dir,
                                            join.client_index, join.engine_pid, **common)
    except BaseException:
        sock.close()
        raise
    http = http_implementation()
    limits, cap_reason = _connection_limits(args, _max_running_bound(args) +
                                            args.max_waiting_requests)
    settings = {"host": args.host, "port": args.port, "http": http, "loop": "uvloop",
                "http_header_timeout": limits.header_timeout,
                "http_body_timeout": limits.body_timeout,
                "max_connections": limits.max_connections,
                "max_connections_reason": cap_reason,
                "max_waiting_requests": args.max_waiting_requests,
                "api_servers": args.api_servers,
                "api_server_index": join.client_index if join else 0,
                "engine_args": json.loads(json.dumps(engine_kwargs_from_args(args),
                                                     default=str))}
    settings["responses_store"] = responses.path
    app = build_app(client, args.api_key, settings=settings,
                    tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser, responses=responses)
    protocol = protocol_class(http, limits, app.state.ctx.metrics)
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop", http=protocol,
                            access_log=False, log_level=args.log_level, lifespan="on",
                            backlog=_BACKLOG)
    server = _server(config, app)
    # uvicorn restores these after its graceful shutdown and re-raises the signal it got:
    # make that a no-op, so a handled SIGINT/SIGTERM ends in a clean exit code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    code = 0
    try:
        code = await _supervise(client, server, serving, join is None or join.client_index == 0)
        await serving
    finally:
        await shutdown_engine(app)
    return EXIT_ENGINE_DIED if client.died.is_set() else code


async def _supervise(client: Any, server: Any, serving: asyncio.Task, show_report: bool) -> int:
    """While uvicorn serves: wait for the engine's start-up (exit code 1 if it fails), then
    for its death (stop the server once the in-flight requests got their errors)."""
    starting = asyncio.create_task(client.wait_ready())
    await asyncio.wait({serving, starting}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal stopped the server during start-up
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        return 0
    if starting.exception() is not None:  # the engine's own error names the problem
        logger.error("%s", starting.exception())
        server.should_exit = True
        return 1
    freeze_heap()  # what start-up built lives as long as the process: keep GC off it
    if show_report:
        print(client.capacity_report["text"], flush=True)
    died = asyncio.create_task(client.died.wait())
    await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
    if not died.done():
        died.cancel()
        return 0
    logger.error("the engine process died: ending every request with an error, then exiting "
                 "with code %d", EXIT_ENGINE_DIED)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DRAIN_SECONDS
    while client.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    server.should_exit = True
    return EXIT_ENGINE_DIED


def _max_running_bound(args: argparse.Namespace) -> int:
    """The most requests the engine can run, known before its start-up ends: the explicit cap,
    or the request pool that bounds the "auto" one."""
    from moeserve.config import SchedulerConfig

    cap = args.max_running_requests
    if cap is not None and str(cap).isdigit():
        return int(cap)
    pool = args.request_pool
    return int(pool) if pool is not None else SchedulerConfig.__dataclass_fields__[
        "request_pool"].default


def _connection_limits(args: argparse.Namespace,
                       queue_bound: int) -> tuple[ConnectionLimits, str]:
    """The flags' deadlines, and the connection cap with its reason: --max-connections, or
    derived from the open-files limit (raised here to the hard limit) and the queue bound."""
    from moeserve.server.process.connections import ConnectionLimits, resolve_max_connections

    open_files = raise_open_files_limit()
    cap, reason = resolve_max_connections(args.max_connections, open_files, queue_bound)
    limits = ConnectionLimits(args.http_header_timeout, args.http_body_timeout, cap)
    logger.info("connections: at most %d open (%s); request headers within %g s, a body "
                "within %g s of its headers", cap, reason, limits.header_timeout,
                limits.body_timeout)
    return limits, reason


def _server(config: Any, app: FastAPI) -> Any:
    """A uvicorn.Server that shuts the engine client down before waiting for connections."""
    import uvicorn

    from moeserve.server.app import shutdown_engine

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            logger.info("shutting down: ending in-flight requests, stopping the engine")
            await shutdown_engine(app)
            await super().shutdown(sockets)

    return Server(config)
