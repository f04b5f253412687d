"""One real `moeserve serve` subprocess (tests/faults/serve.py: tiny-moe on CPU, max_model_len
64) on a free port of 127.0.0.1, shared by the module's tests and stopped after them; its log
goes to a file that a failing test can quote."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.serve import ServeProcess


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    server = ServeProcess(tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()
