"""The fault suite under load, against a real `moeserve serve` (tiny-moe, CPU): overload at 4x the
queue bound loses nothing, and mid-stream disconnects free every KV block.

The overload test holds the engine's steps (MOESERVE_FAULT_INJECT hold_steps) until every request
beyond the queue bound has had its answer, so exactly the queue bound is admitted; the disconnect
test slows the steps (slow_step), as a loaded GPU is slower than its clients. What is asserted is
behaviour (every request ends with a finish reason, a 429 or a refused connection; the blocks
come back), never a time or a rate.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import pytest

from tests.faults.figures import record
from tests.faults.serve import ServeProcess
from tests.wait import async_wait_until

MAX_RUNNING, MAX_WAITING = 8, 24
QUEUE_BOUND = MAX_RUNNING + MAX_WAITING
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True, "stream": True}
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=300)  # only so that a hang fails


@dataclass
class Outcomes:
    finished: int = 0  # 200 and a stream that ended with a finish reason and [DONE]
    rejected_429: int = 0  # with Retry-After
    refused_at_accept: int = 0  # the connection cap: a 503 at accept, or a reset connection
    lost: list[str] = field(default_factory=list)  # anything else


async def _one(session: aiohttp.ClientSession, url: str, out: Outcomes) -> None:
    try:
        async with session.post(f"{url}/v1/completions", json=BODY) as r:
            if r.status == 429:
                assert r.headers.get("Retry-After"), "a 429 without Retry-After"
                out.rejected_429 += 1
                return
            if r.status == 503 and "connection" in (await r.text()).lower():
                out.refused_at_accept += 1
                return
            if r.status != 200:
                out.lost.append(f"status {r.status}: {await r.text()}")
                return
            finish, done = None, False
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        out.lost.append(f"error event: {event}")
                        return
                    finish = event["choices"][0]["finish_reason"] or finish
            if finish != "length" or not done:
                out.lost.append(f"stream ended with finish {finish!r}, [DONE] {done}")
                return
            out.finished += 1
    except (aiohttp.ClientConnectionError, ConnectionResetError):
        out.refused_at_accept += 1


def test_overload_at_4x_the_queue_bound_loses_nothing(tmp_path: Path) -> None:
    go = tmp_path / "go"
    server = ServeProcess(tmp_path, "--max-running-requests", str(MAX_RUNNING),
                          "--max-waiting-requests", str(MAX_WAITING), faults=f"hold_steps:{go}")
    try:
        out = Outcomes()

        async def main() -> None:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=CLIENT_TIMEOUT) as session:
                tasks = [asyncio.create_task(_one(session, server.url, out))
                         for _ in range(4 * QUEUE_BOUND)]
                await async_wait_until(  # every request beyond the bound has its answer
                    lambda: out.rejected_429 + out.refused_at_accept + len(out.lost)
                    >= 3 * QUEUE_BOUND or all(t.done() for t in tasks),
                    "the requests beyond the queue bound answered", timeout_s=120)
                go.touch()  # now the engine may step
                await asyncio.gather(*tasks)

        asyncio.run(main())
        stats = _idle_stats(server)
    finally:
        server.stop()
    record("overload (4x the queue bound)", requests=4 * QUEUE_BOUND, queue_bound=QUEUE_BOUND,
           finished=out.finished, rejected_429=out.rejected_429,
           refused_at_accept=out.refused_at_accept, lost=len(out.lost))
    assert not out.lost, out.lost[:5]
    assert out.finished + out.rejected_429 + out.refused_at_accept == 4 * QUEUE_BOUND
    assert out.finished == QUEUE_BOUND and out.rejected_429 == 3 * QUEUE_BOUND
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0


def test_mid_stream_disconnects_free_every_block(tmp_path: Path) -> None:
    num_streams = 200
    server = ServeProcess(tmp_path, "--max-running-requests", "64", faults="slow_step:25")
    try:
        before = server.engine_state()["stats"]["num_aborted"]

        async def open_and_drop(session: aiohttp.ClientSession) -> bool:
            body = {**BODY, "max_tokens": 60}
            async with session.post(f"{server.url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for raw in r.content:  # the first token has arrived: drop the stream
                    if raw.startswith(b"data: {"):
                        return b'"finish_reason":null' in raw
            return False

        async def main() -> list[bool]:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=CLIENT_TIMEOUT) as session:
                return await asyncio.gather(*(open_and_drop(session)
                                              for _ in range(num_streams)))

        mid_stream = asyncio.run(main())
        stats = _idle_stats(server)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
    num_dropped = sum(mid_stream)
    record("mid-stream disconnects", streams=num_streams, dropped_mid_stream=num_dropped,
           aborted_in_engine=stats["num_aborted"] - before, leaked_blocks_kv_usage=stats[
               "kv_usage"], running_after=stats["num_running"])
    assert num_dropped == num_streams  # each was dropped before its last token
    assert stats["num_aborted"] - before == num_streams
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0
    assert "moeserve_client_disconnects_total 200.0" in metrics


def _idle_stats(server: ServeProcess) -> dict:
    """The engine's stats once it has no request left (polls; a bound only against a hang)."""
    deadline = time.monotonic() + 120
    while True:
        stats = server.engine_state()["stats"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 or \
                time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _no_leftover_ipc(tmp_path: Path) -> None:
    yield
    assert not list(tmp_path.glob("moeserve-*")), "an IPC folder was left behind"
