"""End to end: a real `moeserve serve` subprocess (tiny-moe on CPU), driven by the official `openai`
client, by raw HTTP for the failure cases, and by `moeserve bench`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import psutil
import pydantic
import pytest

SERVE = [sys.executable, "-m", "moeserve.cli", "serve", "--preset", "tiny-moe", "--device", "cpu",
         "--max-model-len", "512"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*SERVE, "--port", str(self.port), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready")

    def engine_pid(self) -> int:
        """The spawned engine process (not multiprocessing's resource tracker)."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        return next(c.pid for c in children if "spawn_main" in " ".join(c.cmdline()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def _engine_state(url: str) -> dict:
    return httpx.get(f"{url}/v1/engine", timeout=5).json()


def test_openai_completions_and_chat(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    stream = client.completions.create(model=model, prompt="Hello", max_tokens=7, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 7
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5,
        temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    chat_stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pieces = list(chat_stream)
    content = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert content == chat.choices[0].message.content
    assert pieces[-1].usage.completion_tokens == 5


def test_openai_sdk_with_tools_and_a_history_of_calls(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Time in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    chat = client.chat.completions.create(model="tiny-moe", messages=messages, tools=tools,
                                          max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model="tiny-moe", messages=messages, tools=tools, max_tokens=6, temperature=0,
        stream=True, extra_body={"ignore_eos": True}))
    whole = chat.choices[0].message
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == (whole.content or "")
    assert [t for d in deltas for t in d.tool_calls or ()] == (whole.tool_calls or [])
    forced = client.chat.completions.create(
        model="tiny-moe", messages=messages, tools=tools, tool_choice="required", seed=4,
        max_tokens=120)
    assert forced.choices[0].message.tool_calls or forced.choices[0].finish_reason == "length"


class Trip(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = pydantic.Field(ge=1, le=9)


def test_the_sdk_parses_a_structured_reply(server: Server) -> None:
    """The official SDK's own structured-output path: a pydantic model sent as a strict
    json_schema response_format, the reply parsed back into it by the SDK."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    reply = client.chat.completions.parse(
        model="tiny-moe", messages=[{"role": "user", "content": "Plan a trip"}],
        response_format=Trip, max_tokens=40, seed=1)
    assert isinstance(reply.choices[0].message.parsed, Trip)


def test_unsupported_field_is_rejected(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="tiny-moe", prompt="Hi", max_tokens=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-moe", prompt="Hi", max_tokens=3,
                                  presence_penalty=2.5)
    reply = client.completions.create(model="tiny-moe", prompt="Hi", max_tokens=3,
                                      presence_penalty=0.5, frequency_penalty=0.5,
                                      logit_bias={"65": 5})  # served since session 58
    assert 1 <= reply.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny-moe", prompt=[1] * 600, max_tokens=3)


def test_bench_counts_equal_server_usage(server: Server, tmp_path: Path) -> None:
    from moeserve.bench.cli import run_bench_argv

    out = tmp_path / "bench.jsonl"
    rc = run_bench_argv(["--url", server.url, "--input-len", "16", "--output-len", "12",
                         "--num-prompts", "8", "--max-concurrency", "4", "--output-json",
                         str(out)])
    assert rc == 0
    run = json.loads(out.read_text().splitlines()[-1])
    assert run["completed"] == 8 and run["failed"] == 0
    for r in run["requests"]:
        assert r["output_len"] == 12
        assert r["streamed_tokens"] == r["output_len"]  # counted in the stream == usage


def test_disconnect_frees_blocks(server: Server) -> None:
    async def main() -> None:
        body = {"model": "tiny-moe", "prompt": [1, 2, 3], "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break  # one event, then the client goes away
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = _engine_state(server.url)["stats"]
            if state["num_running"] == 0 and state["kv_usage"] == 0.0:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"request still holds blocks: {state}")

    before = _engine_state(server.url)["stats"]["num_aborted"]
    asyncio.run(main())
    assert _engine_state(server.url)["stats"]["num_aborted"] == before + 1


def test_queue_full_gets_429() -> None:
    s = Server("--max-running-requests", "1", "--max-waiting-requests", "1")
    try:
        async def main() -> list[httpx.Response]:
            body = {"model": "tiny-moe", "prompt": [5, 6], "max_tokens": 60, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.create_task(client.post(f"{s.url}/v1/completions", json=body))
                         for _ in range(4)]
                return await asyncio.gather(*tasks)

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert codes.count(200) == 2 and codes.count(429) == 2
        limited = next(r for r in responses if r.status_code == 429)
        assert limited.headers["retry-after"]
    finally:
        s.stop()


def test_api_key() -> None:
    s = Server("--api-key", "sekret")
    try:
        body = {"model": "tiny-moe", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"{s.url}/v1/completions", json=body).status_code == 401
        ok = httpx.post(f"{s.url}/v1/completions", json=body,
                        headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_engine_death_ends_the_server_with_code_3() -> None:
    """A dead engine ends the server (for its supervisor to restart it), never a server that
    answers 503 forever; tests/faults covers the streams in flight."""
    s = Server()
    try:
        psutil.Process(s.engine_pid()).kill()
        assert s.proc.wait(60) == 3
    finally:
        s.stop()


def test_sigterm_ends_inflight_and_leaves_no_process() -> None:
    s = Server()
    children = psutil.Process(s.proc.pid).children(recursive=True)

    async def stream_until_closed() -> str:
        body = {"model": "tiny-moe", "prompt": [1, 2], "max_tokens": 500, "stream": True,
                "ignore_eos": True}
        lines = []
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    lines.append(line)
                    if len(lines) == 3:
                        os.kill(s.proc.pid, signal.SIGTERM)
        return "\n".join(lines)

    try:
        text = asyncio.run(stream_until_closed())
        assert s.proc.wait(30) == 0
    finally:
        s.stop()
    assert "error" in text  # the in-flight stream ended with an error event
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"processes left behind: {alive}"


def test_several_api_processes_share_one_engine() -> None:
    s = Server("--api-servers", "2")
    try:
        procs = psutil.Process(s.proc.pid).children(recursive=True)
        apis = [p for p in procs if "spawn_main" in " ".join(p.cmdline())]
        assert len(apis) == 3  # two API processes and the engine

        async def main() -> list[dict]:
            body = {"model": "tiny-moe", "prompt": [7, 8, 9], "max_tokens": 6, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=60) as client:
                rs = await asyncio.gather(*(client.post(f"{s.url}/v1/completions", json=body)
                                            for _ in range(24)))
            return [r.json() for r in rs]

        results = asyncio.run(main())
        assert all(r["usage"]["completion_tokens"] == 6 for r in results)
        metrics = httpx.get(f"{s.url}/metrics").text
        # counters are summed over both API processes, whichever one answers the scrape
        assert 'moeserve_requests_total{finish_reason="length"} 24.0' in metrics
        assert "moeserve_generation_tokens_total 144.0" in metrics
        # one store of responses for both: a new connection lands on either process
        created = httpx.post(f"{s.url}/v1/responses", timeout=60, json={
            "model": "tiny-moe", "input": "Hi", "max_output_tokens": 2}).json()
        found = [httpx.get(f"{s.url}/v1/responses/{created['id']}", timeout=30).status_code
                 for _ in range(16)]
        assert found == [200] * 16
        follow = httpx.post(f"{s.url}/v1/responses", timeout=60, json={
            "model": "tiny-moe", "input": "More", "max_output_tokens": 2,
            "previous_response_id": created["id"]})
        assert follow.status_code == 200, follow.text
    finally:
        s.stop()
    assert s.proc.returncode == 0
    _, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, f"processes left behind: {alive}"


def test_expert_load_in_metrics_and_engine_state(server: Server) -> None:
    body = {"model": "tiny-moe", "prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    stats = _engine_state(server.url)["stats"]
    load = stats["expert_load"]
    assert load["num_steps"] > 0 and len(load["tokens_per_expert"]) == 4  # tiny-moe: 4 layers
    assert stats["gpu_step_seconds"] >= stats["attention_seconds"] + stats["moe_seconds"] > 0
    assert stats["loop_seconds"] >= stats["intake_seconds"] + stats["send_seconds"]
    assert stats["loop_seconds"] > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "moeserve_engine_loop_seconds " in metrics
    assert "moeserve_expert_tokens_per_step " in metrics
    assert "moeserve_expert_load_imbalance " in metrics


def _until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a reset counts as closed too)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _request_head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def _deadlines_pass(s: Server) -> None:
    """Headers that never end, a body that stalls, a body cut short by its client, a 405."""
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        assert _until_closed(sock) == b""  # closed at the header deadline, nothing answered
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(_request_head(100) + b'{"prompt": ')
        answer = _until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == 408
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(_request_head(100) + b'{"prompt": ')  # then the client goes away
    r = httpx.get(f"{s.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int,
                  while_open: Callable[[], Awaitable[object]] | None = None) -> list[dict]:
    """A streamed completion's events (asserting it ends well); `while_open` is awaited after
    the first, with the response in progress."""
    body = {"model": "tiny-moe", "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) == 1 and while_open is not None:
                    await while_open()
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    return [json.loads(e) for e in events[:-1]]


def test_connection_deadlines_and_cap() -> None:
    """One server with short deadlines and a cap of 4 connections (the flags): a long stream is
    not cut while other connections' deadlines pass; the 5th connection gets 503 at accept and
    the 4 open ones finish; a client gone mid-body leaves no traceback in the log."""
    s = Server("--http-header-timeout", "0.3", "--http-body-timeout", "0.3",
               "--max-connections", "4")
    try:
        settings = _engine_state(s.url)["server"]
        assert settings["max_connections"] == 4 and settings["http_body_timeout"] == 0.3
        assert settings["max_connections_reason"].startswith("--max-connections")

        async def long_stream() -> list[dict]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await _stream(client, s.url, 16,
                                     lambda: asyncio.to_thread(_deadlines_pass, s))

        events = asyncio.run(long_stream())
        assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 16

        deadline = time.monotonic() + 30  # every connection so far closed, but the scrape's
        while _metric(s.url, "moeserve_num_connections") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        async def at_the_cap() -> tuple[bytes, list[list[dict]]]:
            clients = [httpx.AsyncClient(timeout=60) for _ in range(4)]
            opened = [asyncio.Event() for _ in clients]

            async def mark(i: int) -> None:
                opened[i].set()

            tasks = [asyncio.create_task(_stream(c, s.url, 4, lambda i=i: mark(i)))
                     for i, c in enumerate(clients)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 60)

            def fifth() -> bytes:
                with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
                    sock.sendall(_request_head(2) + b"{}")
                    return _until_closed(sock)

            refused = await asyncio.to_thread(fifth)
            streams = await asyncio.gather(*tasks)
            for c in clients:
                await c.aclose()
            return refused, streams

        refused, streams = asyncio.run(at_the_cap())
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == 503
        assert all(sum(len(e["choices"][0]["token_ids"]) for e in events) == 4
                   for events in streams)  # the open connections kept working
        assert _metric(s.url, "moeserve_connections_refused_total") == 1
        assert _metric(s.url, 'moeserve_connection_timeouts_total{phase="headers"}') == 1
        assert _metric(s.url, 'moeserve_connection_timeouts_total{phase="body"}') == 1
        assert _metric(s.url, "moeserve_client_disconnects_total") == 1  # not the 408's
    finally:
        s.stop()
    log = s.proc.stdout.read()
    assert "connections: at most 4 open" in log
    assert "Traceback" not in log and "Exception in ASGI" not in log, log


def test_a_responses_store_file_outlives_the_server(tmp_path: Path) -> None:
    """--responses-store PATH: a response stored before a restart is found after it; a path
    that does not open stops the start-up at once, named."""
    path = str(tmp_path / "responses.sqlite")
    s = Server("--responses-store", path)
    try:
        created = httpx.post(f"{s.url}/v1/responses", timeout=60, json={
            "model": "tiny-moe", "input": "Hi", "max_output_tokens": 2}).json()
    finally:
        s.stop()
    s = Server("--responses-store", path)
    try:
        again = httpx.get(f"{s.url}/v1/responses/{created['id']}", timeout=30)
        assert again.status_code == 200 and again.json() == created
    finally:
        s.stop()
    bad = subprocess.run([*SERVE, "--port", str(_free_port()), "--responses-store",
                          str(tmp_path / "no" / "such" / "dir.sqlite")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--responses-store" in bad.stdout + bad.stderr
    assert "no/such/dir.sqlite" in bad.stdout + bad.stderr
