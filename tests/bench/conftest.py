from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.bench.fake_server import FakeServer


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """A streaming OpenAI-style test server; tune `fake_server.state.options` per test."""
    with FakeServer() as server:
        yield server
