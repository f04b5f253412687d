"""Small HTTP helpers for the route tests."""

from __future__ import annotations

import json
from typing import Any

import httpx

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def post(http: httpx.Client, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """POST and return the JSON of a 200 (assert it is one)."""
    r = http.post(path, json=body, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST with stream=true; the events' JSON, in order. Asserts the stream ends in [DONE]."""
    events: list[dict[str, Any]] = []
    done = False
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            assert not done, "an event after [DONE]"
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
            else:
                events.append(json.loads(data))
    assert done, "the stream did not end with [DONE]"
    return events


def rejected(http: httpx.Client, path: str, body: dict[str, Any], status: int = 400,
             **kw: Any) -> dict[str, Any]:
    """POST expecting an OpenAI-style error with this status; returns the error object."""
    r = http.post(path, json=body, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and isinstance(error["message"], str)
    return error


def engine_stats(http: httpx.Client) -> dict[str, Any]:
    return http.get("/v1/engine").json()["stats"]
