"""A live server for the route tests: the real AsyncEngineClient (tiny-moe, CPU, its own engine
process) and two uvicorn servers on one event loop in a background thread: the plain app, and
the same client behind an API key. Tests talk to them over real HTTP with httpx."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from moeserve.engine.process.async_client import AsyncEngineClient
from moeserve.server.app import build_app

API_KEY = "test-key"
MAX_MODEL_LEN = 128


class LiveServer:
    def __init__(self, max_model_len: int = MAX_MODEL_LEN) -> None:
        self.max_model_len = max_model_len
        self.sockets = [socket.socket(), socket.socket()]
        for s in self.sockets:
            s.bind(("127.0.0.1", 0))
        self.url, self.keyed_url = (f"http://127.0.0.1:{s.getsockname()[1]}"
                                    for s in self.sockets)
        self.client: AsyncEngineClient | None = None
        self._servers: list[uvicorn.Server] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(120) or self._error is not None:
            raise RuntimeError(f"the test server did not start: {self._error!r}")

    def stop(self) -> None:
        for server in self._servers:
            server.should_exit = True
        self._thread.join(60)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self.client = await AsyncEngineClient.start(
            {"model": "tiny-moe", "device": "cpu", "max_model_len": self.max_model_len},
            max_waiting_requests=64)
        apps = [build_app(self.client, None), build_app(self.client, API_KEY)]
        # The keyed server runs without lifespan: the plain one's shutdown stops the client.
        self._servers = [uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                       lifespan=lifespan, access_log=False))
                         for app, lifespan in zip(apps, ("on", "off"))]
        tasks = [asyncio.create_task(server.serve(sockets=[sock]))
                 for server, sock in zip(self._servers, self.sockets)]
        while not all(s.started for s in self._servers):
            await asyncio.sleep(0.01)
        self._ready.set()
        await asyncio.gather(*tasks)


@pytest.fixture(scope="session")
def live() -> Iterator[LiveServer]:
    server = LiveServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def long_live() -> Iterator[LiveServer]:
    """A server whose prompts have room for tools (the default template lists them)."""
    server = LiveServer(max_model_len=1024)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def long_http(long_live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=long_live.url, timeout=60) as client:
        yield client


@pytest.fixture()
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client
