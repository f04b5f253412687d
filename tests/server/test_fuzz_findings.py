"""Bugs the schemathesis run (tests/faults/test_schema_fuzz.py) found, one regression test each."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import CHAT, COMPLETIONS, MESSAGES, post


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


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "Hi"}),
                                       (CHAT, {"messages": MESSAGES})])
def test_top_p_below_fp32_does_not_kill_the_engine(http: httpx.Client, path: str,
                                                   body: dict) -> None:
    """top_p 5e-324 passes the (0, 1] check but is 0 in the sampler's fp32 tensor: no token had
    mass_before < top_p, the sampler gathered at rank -1, and the IndexError ended the engine
    process (every later request a 503). The most likely token is always kept now."""
    out = post(http, path, {**body, "top_p": 5e-324, "temperature": 1.0, "max_tokens": 3,
                            "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 3
    assert http.get("/ready").status_code == 200
