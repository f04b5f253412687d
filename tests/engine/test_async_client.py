"""The engine core in its own process, driven through AsyncEngineClient (ZMQ + msgspec)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine.process.async_client import AsyncEngineClient, EngineDeadError, QueueFullError
from tests.wait import TIMEOUT_S, async_wait_until

ENGINE = {"model": "tiny-moe", "device": "cpu", "max_model_len": 256}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [300, 301]]


async def _collect(client: AsyncEngineClient, rid: str, prompt: list[int],
                   params: SamplingParams = GREEDY) -> tuple[list[int], str, list]:
    tokens, text, outs = [], "", []
    async for out in client.generate(rid, prompt, params):
        tokens += out.new_token_ids
        text += out.text
        outs.append(out)
    return tokens, text, outs


def test_outputs_equal_in_process_engine() -> None:
    expected = LLM(**ENGINE).generate(PROMPTS, GREEDY)

    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE)
        try:
            assert client.max_model_len == 256 and client.capacity_report["kv_tokens"] > 0
            assert "max running requests" in client.capacity_report["text"]
            assert await client.check_ready()
            results = await asyncio.gather(*(_collect(client, f"r{i}", p)
                                             for i, p in enumerate(PROMPTS)))
            for (tokens, text, outs), ref in zip(results, expected):
                assert tokens == ref.token_ids and text == ref.text
                assert outs[-1].finished and outs[-1].finish_reason.value == "length"
            assert client.num_in_flight == 0
        finally:
            await client.shutdown()
        assert not client.alive

    asyncio.run(main())


def test_a_slow_consumer_gets_waiting_steps_merged() -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLM(**ENGINE).generate([PROMPTS[1]], params)[0]

    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE)
        try:
            tokens, text, outs = [], "", []
            async for out in client.generate("slow", PROMPTS[1], params):
                tokens += out.new_token_ids
                text += out.text
                outs.append(out)
                if len(outs) == 1:  # the consumer falls behind: steps queue up meanwhile
                    await async_wait_until(lambda: client._queues["slow"].qsize() >= 2,
                                           "two steps waiting in the request's queue")
            assert tokens == expected.token_ids and text == expected.text
            assert len(outs) < len(tokens)  # several steps came as one output
            assert outs[-1].finished and [o.finished for o in outs[:-1]] == [False] * (
                len(outs) - 1)
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_bad_request_refused_before_the_engine() -> None:
    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE)
        try:
            good = asyncio.create_task(_collect(client, "good", PROMPTS[1]))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await _collect(client, "bad", [1, 99999])
            with pytest.raises(ValueError, match="max_model_len"):
                await _collect(client, "long", [1] * 256)
            tokens, _, _ = await good
            assert len(tokens) == 8
            assert client.stats.num_refused == 0  # never reached the engine
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_queue_bound_and_abort_on_consumer_exit() -> None:
    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE | {"max_running_requests": 1},
                                               max_waiting_requests=1)
        try:
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            first = client.generate("a", PROMPTS[0], long)
            await first.__anext__()  # running
            second = asyncio.create_task(_collect(client, "b", PROMPTS[2]))
            await asyncio.sleep(0.05)
            with pytest.raises(QueueFullError, match="waiting queue"):
                await _collect(client, "c", PROMPTS[2])
            await first.aclose()  # the consumer goes away: the engine aborts "a"
            tokens, _, _ = await second
            assert len(tokens) == 8
            assert await client.check_ready()
            assert client.stats.num_aborted == 1
            assert client.stats.num_running == 0 and client.stats.kv_usage == 0.0
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_stop_string_finishes_request() -> None:
    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE)
        try:
            _, text, _ = await _collect(client, "x", PROMPTS[1])
            stop = text[2:4]
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop])
            _, cut, outs = await _collect(client, "y", PROMPTS[1], params)
            assert cut == text[: text.index(stop)]
            assert outs[-1].finish_reason.value == "stop" and outs[-1].stop_reason == stop
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_engine_death_fails_requests_fast() -> None:
    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE)
        try:
            long = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
            stream = client.generate("a", PROMPTS[0], long)
            await stream.__anext__()
            os.kill(client._proc.pid, signal.SIGKILL)

            async def drain() -> None:
                async for _ in stream:
                    pass

            # the watchdog ends the waiting stream (the timeout only keeps a hang from lasting
            # forever: without the watchdog nothing would ever end it)
            with pytest.raises(EngineDeadError, match="the engine process died"):
                await asyncio.wait_for(drain(), TIMEOUT_S)
            assert not client.alive and not await client.check_ready()
            with pytest.raises(EngineDeadError):
                await _collect(client, "b", PROMPTS[0])
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_startup_failure_is_reported() -> None:
    async def main() -> None:
        with pytest.raises(RuntimeError, match="max_model_len 99999 exceeds"):
            await AsyncEngineClient.start(ENGINE | {"max_model_len": 99999})

    asyncio.run(main())


def test_a_failing_output_reader_fails_every_request_and_marks_the_engine_dead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without this, a message the reader cannot handle would leave every stream waiting for
    outputs that never come, while the server looked healthy."""
    from moeserve.engine.process import async_client as module

    async def main() -> None:
        client = await AsyncEngineClient.start(ENGINE)
        try:
            def broken(data: bytes) -> object:
                raise ValueError("undecodable message")

            monkeypatch.setattr(module.p, "decode_from_engine", broken)
            with pytest.raises(EngineDeadError, match="can no longer be read"):
                await asyncio.wait_for(_collect(client, "r", PROMPTS[0]), TIMEOUT_S)
            assert client.died.is_set() and not client.alive
        finally:
            await client.shutdown()

    asyncio.run(main())
