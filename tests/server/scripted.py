"""A scripted engine reply for the renderer tests of the APIs whose streams name their events
(the Messages and Responses APIs): outputs cut into pieces, a generation that yields them, and
the renderer's stream parsed back from its SSE bytes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from moeserve.types import FinishReason, RequestOutput


def outputs(text: str, step: int, finish: FinishReason) -> list[RequestOutput]:
    """The reply as engine outputs of `step` characters (one byte token a character)."""
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [RequestOutput("r", [1], [ord(c) % 256 for c in piece], finished=k == len(pieces) - 1,
                          finish_reason=finish if k == len(pieces) - 1 else None, text=piece)
            for k, piece in enumerate(pieces)]


class ScriptedGeneration:
    def __init__(self, outs: list[RequestOutput]) -> None:
        self._outputs = outs
        self.closed = False

    async def outputs(self) -> Any:
        for out in self._outputs:
            yield 0, out

    async def aclose(self) -> None:
        self.closed = True


class NullTimer:
    def on_tokens(self, i: int, n: int) -> None: ...
    def on_finished(self, i: int, reason: str) -> None: ...
    def on_done(self) -> None: ...


def named_events(renderer: Any, text: str, step: int,
                 finish: FinishReason = FinishReason.STOP) -> list[dict[str, Any]]:
    """`renderer.stream`'s events for the scripted reply, each `event: <type>` checked against
    its data's type; asserts the generation was closed and the end logged without an error."""
    gen = ScriptedGeneration(outputs(text, step, finish))
    ended: list[Any] = []

    async def run() -> bytes:
        return b"".join([chunk async for chunk in renderer.stream(
            gen, NullTimer(), lambda results, error: ended.append(error))])

    events = []
    for frame in asyncio.run(run()).decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append(payload)
    assert gen.closed and ended == [None]
    return events
