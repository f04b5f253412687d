"""The fault suite's process faults, against a real `moeserve serve` (tiny-moe, CPU): the engine
killed, the API process killed, the launcher of --api-servers killed, a request's own fault,
a fault of no one request, and /health through a long start-up. Behaviour only: each wait is
for an event (a process exit, a status), bounded only against a hang."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest

from moeserve.server.process.launch import EXIT_ENGINE_DIED
from tests.faults.figures import record
from tests.faults.serve import ServeProcess
from tests.wait import wait_until

STREAM = {"prompt": [3, 4, 5], "max_tokens": 60, "ignore_eos": True, "stream": True}
TIMEOUT = aiohttp.ClientTimeout(total=120)  # only so that a hang fails
EXIT_WAIT_S = 60


async def _stream_events(session: aiohttp.ClientSession, url: str, body: dict,
                         started: asyncio.Event | None = None,
                         headers: dict | None = None) -> list:
    """Every event of one stream (parsed JSON, "[DONE]" as is); `started` is set at the first."""
    events: list = []
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return events


async def _streams_through(url: str, num: int, when_all_started) -> list[list]:
    """Open `num` streams; once each has its first event, call `when_all_started()`."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = [asyncio.Event() for _ in range(num)]
        tasks = [asyncio.create_task(_stream_events(session, url, STREAM, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        when_all_started()
        return await asyncio.gather(*tasks, return_exceptions=True)


def test_engine_kill_gives_every_stream_an_error_then_exit_3(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path, faults="slow_step:20")
    engine = server.engine()
    streams = asyncio.run(_streams_through(server.url, 16, engine.kill))
    code = server.proc.wait(EXIT_WAIT_S)
    with_error = sum(1 for events in streams if isinstance(events, list) and len(events) >= 2
                     and "error" in events[-2] and events[-1] == "[DONE]")
    record("engine kill -9", streams=len(streams), streams_with_error_event=with_error,
           exit_code=code, ipc_folders_left=len(server.ipc_folders()))
    assert with_error == len(streams), streams
    assert code == EXIT_ENGINE_DIED
    assert "the engine process died" in server.output()
    assert not server.ipc_folders()


def test_api_kill_under_load_leaves_no_process_and_no_ipc_folder(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path, faults="slow_step:20")
    children = server.children()
    assert any(p.pid == server.engine().pid for p in children)
    asyncio.run(_streams_through(server.url, 16, server.proc.kill))
    server.proc.wait(EXIT_WAIT_S)
    _, alive = psutil.wait_procs(children, timeout=EXIT_WAIT_S)
    record("API process kill -9 under load", processes_left=len(alive),
           ipc_folders_left=len(server.ipc_folders()))
    assert not alive, f"processes left behind: {alive}"
    assert not server.ipc_folders()


def test_launcher_kill_leaves_no_process_and_an_api_death_ends_it(tmp_path: Path) -> None:
    server = ServeProcess(tmp_path, "--api-servers", "2", faults="slow_step:5")
    children = server.children()
    assert len([p for p in children if "spawn_main" in " ".join(p.cmdline())]) == 3
    asyncio.run(_streams_through(server.url, 8, server.proc.kill))  # the launcher, kill -9
    _, alive = psutil.wait_procs(children, timeout=EXIT_WAIT_S)
    assert not alive, f"processes left behind: {alive}"
    assert not server.ipc_folders()

    server = ServeProcess(tmp_path, "--api-servers", "2")
    children = server.children()
    api = psutil.Process(server.engine_state()["server"]["pid"])
    api.send_signal(signal.SIGKILL)
    code = server.proc.wait(EXIT_WAIT_S)
    _, alive = psutil.wait_procs(children, timeout=EXIT_WAIT_S)
    record("--api-servers 2", launcher_kill_processes_left=0, api_kill_launcher_exit=code,
           api_kill_processes_left=len(alive))
    assert code == EXIT_ENGINE_DIED
    assert not alive and not server.ipc_folders()


def test_a_request_fault_fails_it_alone_and_a_forward_fault_ends_the_server(
        tmp_path: Path) -> None:
    faults = ",".join(f"{kind}:bad-{name}{s}" for kind, name in (
        ("nan", "nan"), ("sample", "sample"), ("detokenize", "detok")) for s in ("", "-s"))
    faults += ",step:bad-step"
    server = ServeProcess(tmp_path, "--max-running-requests", "16", faults=faults)
    body = {"prompt": [9, 8, 7], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    url = f"{server.url}/v1/completions"
    try:
        clean = httpx.post(url, json=body, timeout=60).json()["choices"][0]["token_ids"]

        async def main() -> tuple[list, list]:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                async def one(rid: str, stream: bool) -> dict | list:
                    if stream and rid.startswith("good"):
                        return await _stream_events(session, server.url, {**body, "stream": True},
                                                    headers={"X-Request-Id": rid})
                    headers = {"X-Request-Id": f"{rid}-s" if stream else rid}
                    async with session.post(url, json={**body, "stream": stream},
                                            headers=headers) as r:
                        return {"status": r.status, **(await r.json())}

                bad = [one(f"bad-{k}", stream) for k in ("nan", "sample", "detok")
                       for stream in (False, True)]
                good = [one(f"good-{i}", i % 2 == 1) for i in range(10)]
                results = await asyncio.gather(*bad, *good)
                return results[:len(bad)], results[len(bad):]

        bad, good = asyncio.run(main())
        # each faulted request failed alone: 500 naming the fault (streamed too: the fault
        # comes with its first token, before the headers go out)
        for result in bad:
            assert result["status"] == 500 and "failed in the engine" in \
                result["error"]["message"], result
        for result in good:  # and everyone else got the clean answer
            tokens = result["choices"][0]["token_ids"] if isinstance(result, dict) else \
                [t for e in result[:-1] for t in e["choices"][0]["token_ids"]]
            assert tokens == clean
        stats = server.engine_state()["stats"]
        assert stats["num_failed"] == len(bad)
        assert httpx.get(f"{server.url}/health").status_code == 200
        # a fault that belongs to no one request fails the engine loudly; the server exits 3
        r = httpx.post(url, json=body, headers={"X-Request-Id": "bad-step"}, timeout=60)
        assert r.status_code == 503, r.text
        code = server.proc.wait(EXIT_WAIT_S)
    finally:
        server.stop()
    record("request faults", faulted=len(bad), failed_alone=stats["num_failed"],
           others_served_exactly=len(good), forward_fault_exit=code)
    assert code == EXIT_ENGINE_DIED
    assert "InjectedFault: injected step fault" in server.output()


def test_health_answers_through_a_long_start_up(tmp_path: Path) -> None:
    go = tmp_path / "go"
    server = ServeProcess(tmp_path, faults=f"hold_startup:{go}", wait="/health")
    try:
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok",
                                                            "engine": "starting"}
        ready = httpx.get(f"{server.url}/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "the engine is starting"
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "starting" in r.json()["error"]["message"]
        go.touch()
        server.wait_for("/ready")
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert server.proc.returncode == 0


@pytest.fixture(autouse=True)
def _no_leftover_ipc(tmp_path: Path) -> None:
    yield
    wait_until(lambda: not list(tmp_path.glob("moeserve-*")), "no IPC folder left behind")
