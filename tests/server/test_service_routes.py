"""API key, /health, /ready, /metrics and /v1/engine."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, LiveServer
from tests.server.helpers import CHAT, COMPLETIONS, MESSAGES, post, rejected, stream

BODY = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture()
def keyed(live: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=live.keyed_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_api_key_required_on_v1(keyed: httpx.Client, headers: dict[str, str]) -> None:
    for method, path, body in [("POST", COMPLETIONS, BODY),
                               ("POST", CHAT, {"messages": MESSAGES, "max_tokens": 2}),
                               ("GET", "/v1/models", None), ("GET", "/v1/engine", None)]:
        r = keyed.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "authentication_error" and "API key" in error["message"]


def test_api_key_accepted_and_open_routes(keyed: httpx.Client) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert post(keyed, COMPLETIONS, BODY, headers=auth)["usage"]["completion_tokens"] == 2
    assert keyed.get("/v1/models", headers=auth).status_code == 200
    for path in ("/health", "/ready", "/metrics"):
        assert keyed.get(path).status_code == 200, path


def test_no_key_needed_without_api_key(http: httpx.Client) -> None:
    assert post(http, COMPLETIONS, BODY, headers={"Authorization": "Bearer anything"})


def test_health_and_ready(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok", "engine": "serving"}
    assert http.get("/ready").json() == {"status": "ready"}


def test_engine_state(http: httpx.Client) -> None:
    state = http.get("/v1/engine").json()
    report = state["capacity_report"]
    assert report["kv_tokens"] > 0 and report["max_running_requests"] >= 1
    assert "max_running_requests_rule" in report
    assert state["server"]["max_model_len"] == MAX_MODEL_LEN
    assert state["server"]["max_waiting_requests"] == 64 and state["server"]["api_key"] is False
    assert state["stats"]["num_running"] == 0 and state["stats"]["kv_usage"] == 0.0


def test_engine_stats_count_settled_steps_and_carry_the_slow_ones(http: httpx.Client) -> None:
    """num_recorded_steps grows with a request's steps; slow_steps (engine/step_counters.py)
    crosses the process boundary as a list of [step, seconds, prompt, rows, generated]."""
    before = http.get("/v1/engine").json()["stats"]["num_recorded_steps"]
    post(http, COMPLETIONS, {**BODY, "max_tokens": 3})
    stats = http.get("/v1/engine").json()["stats"]
    assert stats["num_recorded_steps"] >= before + 3
    assert isinstance(stats["slow_steps"], list)
    assert all(len(s) == 5 and s[1] >= 0.25 for s in stats["slow_steps"])


def _metrics(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z0-9_:]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics(http: httpx.Client, live: LiveServer) -> None:
    before = _metrics(http)
    post(http, COMPLETIONS, {**BODY, "max_tokens": 5})
    events = stream(http, CHAT, {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                 "ignore_eos": True})
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 4
    rejected(http, COMPLETIONS, {**BODY, "top_p": 7})
    after = _metrics(http)
    for name in ("moeserve_num_requests_running", "moeserve_num_requests_waiting",
                 "moeserve_kv_cache_usage", "moeserve_num_requests_in_flight",
                 "moeserve_generation_tokens_per_second", "moeserve_engine_steps_total",
                 "moeserve_engine_preemptions_total", "moeserve_client_disconnects_total",
                 "moeserve_engine_profiled_forwards_total",
                 "moeserve_engine_profiled_device_seconds_total",
                 "moeserve_engine_profiled_wall_seconds_total",
                 'moeserve_requests_rejected_total{reason="queue_full"}',
                 'moeserve_requests_total{finish_reason="abort"}',
                 "moeserve_time_to_first_token_seconds_count",
                 "moeserve_time_per_output_token_seconds_count",
                 "moeserve_e2e_request_latency_seconds_count"):
        assert name in after, name

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("moeserve_generation_tokens_total") == 9
    tok = live.client.tokenizer
    chat_prompt = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert delta("moeserve_prompt_tokens_total") == 2 + len(chat_prompt)
    assert delta('moeserve_requests_total{finish_reason="length"}') == 2
    assert delta('moeserve_requests_rejected_total{reason="invalid_request"}') == 1
    assert delta("moeserve_time_to_first_token_seconds_count") == 2
    assert delta("moeserve_time_per_output_token_seconds_count") == 2
    assert delta("moeserve_e2e_request_latency_seconds_count") == 2
    assert after["moeserve_generation_tokens_per_second"] >= 0
    assert after["moeserve_num_requests_in_flight"] == 0


def test_non_streaming_disconnect_aborts(http: httpx.Client, live: LiveServer) -> None:
    """The lead's end-to-end tests cover a streaming client going away; this is the other path:
    a client waiting for a whole (non-streamed) response leaves, and the request is aborted."""
    before = _engine(http)
    host, port = live.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [4, 4, 4], "max_tokens": MAX_MODEL_LEN - 4,
                       "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while _engine(http)["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while (state := _engine(http))["num_running"] or state["kv_usage"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    assert state["num_aborted"] == before["num_aborted"] + 1
    assert state["num_generated_tokens"] - before["num_generated_tokens"] < MAX_MODEL_LEN - 4


def _engine(http: httpx.Client) -> dict:
    return http.get("/v1/engine").json()["stats"]
