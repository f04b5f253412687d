"""A reply as the Messages API gives it: content blocks (thinking, text, tool_use), its
stop_reason and usage, whole or as server-sent events.

    reply text --ReplyParser (server/agent/)--> ReplyPart(reasoning, content, calls)
               --Blocks--> thinking block, text block, one tool_use block per call

A stream is `message_start`, then per block `content_block_start`, its deltas (thinking_delta,
text_delta, one input_json_delta with a call's whole input) and `content_block_stop`, then
`message_delta` (stop_reason, usage) and `message_stop`; every event is
`event: <type>\\ndata: <json>\\n\\n`. An engine failure mid-stream sends an `error` event and
ends the stream. Blocks follow the reply's runs (agent/runs.py: a block opens at its first piece
that is not whitespace), streamed or whole alike.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from moeserve.server.agent.reply import ReplyParser, reply_part
from moeserve.server.agent.runs import RunEvents, Step
from moeserve.server.metrics import RequestTimer
from moeserve.server.routes.generation import Generation, engine_error
from moeserve.server.routes.serving import ChoiceResult, LogEnd, usage_dict

_encode = msgspec.json.Encoder().encode
_BLOCKS = {"reasoning": "thinking", "content": "text"}
_DELTAS = {"thinking": "thinking_delta", "text": "text_delta"}


def event(payload: dict[str, Any]) -> bytes:
    return b"event: " + payload["type"].encode() + b"\ndata: " + _encode(payload) + b"\n\n"


class Blocks(RunEvents):
    """A reply's parts -> content-block stream events, and the whole blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.content: list[dict[str, Any]] = []  # the whole blocks so far

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                 "input": json.loads(call["function"]["arguments"])}
        index = len(self.content)
        self.content.append(block)
        return [{"type": "content_block_start", "index": index,
                 "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}},
                {"type": "content_block_stop", "index": index}]

    def _event(self, step: Step, status: str = "completed") -> list[dict[str, Any]]:
        index = len(self.content) - (step.action != "open")
        if step.action == "close":
            return [{"type": "content_block_stop", "index": index}]
        kind = _BLOCKS[step.kind]
        if step.action == "open":
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.content.append(block)
            return [{"type": "content_block_start", "index": index,
                     "content_block": dict(block)}]
        self.content[-1][kind] += step.text
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": _DELTAS[kind], kind: step.text}}]


def stop_reason(result: ChoiceResult, num_calls: int,
                stop_sequences: tuple[str, ...]) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished reply."""
    if result.finish_reason is None:
        return None, None
    if result.finish_reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if isinstance(result.stop_reason, str) and result.stop_reason in stop_sequences:
        return "stop_sequence", result.stop_reason
    return "end_turn", None  # the model's end (an "abort" is a client gone: no one reads it)


def message_usage(usage: dict[str, Any]) -> dict[str, int]:
    """OpenAI's usage -> Anthropic's: input_tokens leave out the prefix-cache hits, which are
    cache_read_input_tokens (the engine caches prefixes by itself: no cache creation)."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessageRenderer:
    """One Messages reply, whole (`final`) or streamed (`stream`)."""

    def __init__(self, model: str, request_id: str, prompt: list[int],
                 new_parser: Callable[[], ReplyParser] | None,
                 stop_sequences: tuple[str, ...]) -> None:
        self.model = model
        self.request_id = request_id
        self.prompt = prompt
        self.new_parser = new_parser
        self.stop_sequences = stop_sequences

    def message(self, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
                usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "content": content, "model": self.model, "stop_reason": reason[0],
                "stop_sequence": reason[1], "usage": usage}

    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        (result,) = results
        parser = self.new_parser() if self.new_parser is not None else None
        blocks = Blocks()
        blocks.feed(reply_part(parser, "".join(result.text), final=True))
        num_calls = parser.num_calls if parser is not None else 0
        return self.message(blocks.content, stop_reason(result, num_calls, self.stop_sequences),
                            message_usage(usage))

    async def stream(self, gen: Generation, timer: RequestTimer,
                     log_end: LogEnd) -> AsyncIterator[bytes]:
        result = ChoiceResult()
        parser = self.new_parser() if self.new_parser is not None else None
        blocks = Blocks()
        error: str | None = "client went away"
        started = False
        try:
            async for _, out in gen.outputs():
                result.add(out, keep=False)
                timer.on_tokens(0, len(out.new_token_ids))
                events = []
                if not started:  # after the first output: its prefix-cache hits are known
                    usage = message_usage(usage_dict([self.prompt], [result], 1))
                    events.append({"type": "message_start", "message": self.message(
                        [], (None, None), {**usage, "output_tokens": 0})})
                    started = True
                events += blocks.feed(reply_part(parser, out.text, out.finished))
                if out.finished:
                    timer.on_finished(0, result.finish_reason or "stop")
                    events += blocks.close()
                yield b"".join(event(e) for e in events)
            timer.on_done()
            error = None
            num_calls = parser.num_calls if parser is not None else 0
            reason = stop_reason(result, num_calls, self.stop_sequences)
            yield event({"type": "message_delta",
                         "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                         "usage": message_usage(usage_dict([self.prompt], [result], 1))})
            yield event({"type": "message_stop"})
        except Exception as e:  # the engine died or failed: tell the client, end the stream
            api_error = engine_error(e, None)
            error = api_error.message
            yield event(api_error.to_anthropic_dict(self.request_id))
        finally:
            await gen.aclose()
            log_end([result], error)
