"""Bugs the schemathesis run (tests/faults/test_schema_fuzz.py) found, one regression test each."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import COMPLETIONS


@pytest.mark.parametrize("method,path,allow", [("DELETE", "/health", "GET"),
                                               ("TRACE", "/v1/models", "GET"),
                                               ("PUT", COMPLETIONS, "POST")])
def test_405_names_the_allowed_methods(http: httpx.Client, method: str, path: str,
                                       allow: str) -> None:
    """The app's error handler turned Starlette's 405 into JSON and dropped its Allow header
    (RFC 9110 requires it)."""
    r = http.request(method, path)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    assert r.headers["allow"] == allow
