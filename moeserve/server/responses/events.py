"""A reply as the Responses API gives it: output items (reasoning, message, function_call), the
response object around them, whole or as server-sent events.

    reply text --ReplyParser (server/agent/)--> ReplyPart --Runs (agent/runs.py)--> items:
        a reasoning item (its text as one reasoning_text part), a message item (one
        output_text part), one function_call item per call

A stream is `response.created`, `response.in_progress`, then per item
`response.output_item.added`, for a reasoning or message item `response.content_part.added`,
its deltas (`response.reasoning_text.delta` / `response.output_text.delta`), their `.done` and
`response.content_part.done`, for a call `response.function_call_arguments.delta` (the whole
arguments) and `.done`, then `response.output_item.done`; last `response.completed` (or
`response.incomplete` when max_output_tokens cut it). Every event is `event: <type>\\ndata:
<json>\\n\\n` with a `sequence_number`. An engine failure mid-stream sends an `error` event
and ends the stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from moeserve.server.agent.reply import ReplyParser, reply_part
from moeserve.server.agent.runs import RunEvents, Step
from moeserve.server.metrics import RequestTimer
from moeserve.server.routes.generation import Generation, engine_error
from moeserve.server.routes.serving import ChoiceResult, LogEnd, usage_dict

_encode = msgspec.json.Encoder().encode
_PARTS = {"reasoning": ("reasoning", "rs", "reasoning_text"),
          "content": ("message", "msg", "output_text")}  # kind -> item type, id prefix, part


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part(part_type: str, text: str) -> dict[str, Any]:
    return ({"type": "output_text", "text": text, "annotations": []}
            if part_type == "output_text" else {"type": part_type, "text": text})


class OutputItems(RunEvents):
    """A reply's parts -> output items and their stream events (without sequence numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[dict[str, Any]] = []  # the whole items so far
        self._text = ""

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index, arguments = len(self.items), call["function"]["arguments"]
        item = {"id": _item_id("fc"), "type": "function_call", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": arguments,
                "status": "completed"}
        self.items.append(item)
        head = {"item_id": item["id"], "output_index": index}
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", **head, "delta": arguments},
                {"type": "response.function_call_arguments.done", **head,
                 "arguments": arguments},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def _event(self, step: Step, status: str = "completed") -> list[dict[str, Any]]:
        item_type, prefix, part_type = _PARTS[step.kind]
        if step.action == "open":
            item: dict[str, Any] = {"id": _item_id(prefix), "type": item_type,
                                    "status": "in_progress", "content": []}
            if item_type == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            self.items.append(item)
            self._text = ""
            head = {"item_id": item["id"], "output_index": len(self.items) - 1}
            return [{"type": "response.output_item.added", "output_index": head["output_index"],
                     "item": {**item, "content": []}},
                    {"type": "response.content_part.added", **head, "content_index": 0,
                     "part": _part(part_type, "")}]
        item = self.items[-1]
        head = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        logprobs = {"logprobs": []} if part_type == "output_text" else {}
        if step.action == "text":
            self._text += step.text
            return [{"type": f"response.{part_type}.delta", **head, "delta": step.text,
                     **logprobs}]
        item.update(status=status, content=[_part(part_type, self._text)])
        return [{"type": f"response.{part_type}.done", **head, "text": self._text, **logprobs},
                {"type": "response.content_part.done", **head,
                 "part": _part(part_type, self._text)},
                {"type": "response.output_item.done", "output_index": head["output_index"],
                 "item": item}]


class ResponseRenderer:
    """One Responses reply, whole (`final`) or streamed (`stream`). `echo`: the request's
    settings the response object repeats; `count_tokens`: a text's token count (the reasoning's,
    for usage); `on_done`: called with the finished response object and its output items."""

    def __init__(self, response_id: str, prompt: list[int], echo: dict[str, Any],
                 new_parser: Callable[[], ReplyParser] | None,
                 count_tokens: Callable[[str], int],
                 on_done: Callable[[dict[str, Any]], None]) -> None:
        self.response_id = response_id
        self.prompt = prompt
        self.echo = echo
        self.new_parser = new_parser
        self.count_tokens = count_tokens
        self.on_done = on_done
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None, "incomplete_details": incomplete,
                **self.echo, "output": output, "usage": usage}

    def _usage(self, usage: dict[str, Any], output: list[dict[str, Any]]) -> dict[str, Any]:
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning"
                            for p in item["content"])
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {
                    "reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
                "total_tokens": usage["total_tokens"]}

    def _finish(self, result: ChoiceResult, items: OutputItems,
                usage: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The close events and the finished response object (handed to on_done)."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        events = items.close("incomplete" if status == "incomplete" else "completed")
        body = self.response(status, items.items, self._usage(usage, items.items))
        self.on_done(body)
        return events, body

    def final(self, results: list[ChoiceResult], usage: dict[str, Any]) -> dict[str, Any]:
        (result,) = results
        parser = self.new_parser() if self.new_parser is not None else None
        items = OutputItems()
        text = "".join(result.text)
        items.feed(reply_part(parser, text, final=True))
        return self._finish(result, items, usage)[1]

    async def stream(self, gen: Generation, timer: RequestTimer,
                     log_end: LogEnd) -> AsyncIterator[bytes]:
        """The response's server-sent events, an engine step's at a time."""
        async for batch in self.events(gen, timer, log_end):
            yield b"".join(event_bytes(e) for e in batch)

    async def events(self, gen: Generation, timer: RequestTimer,
                     log_end: LogEnd) -> AsyncIterator[list[dict[str, Any]]]:
        """The response's events (each with its sequence_number), an engine step's at a time;
        an engine failure ends them with an `error` event."""
        result = ChoiceResult()
        parser = self.new_parser() if self.new_parser is not None else None
        items = OutputItems()
        sequence = iter(range(1 << 62))

        def numbered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{**e, "sequence_number": next(sequence)} for e in events]

        error: str | None = "client went away"
        try:
            start = self.response("in_progress", [], None)
            yield numbered([{"type": "response.created", "response": start},
                            {"type": "response.in_progress", "response": start}])
            async for _, out in gen.outputs():
                result.add(out, keep=False)
                timer.on_tokens(0, len(out.new_token_ids))
                events = items.feed(reply_part(parser, out.text, out.finished))
                if out.finished:
                    timer.on_finished(0, result.finish_reason or "stop")
                yield numbered(events)
            timer.on_done()
            error = None
            usage = usage_dict([self.prompt], [result], 1)
            events, body = self._finish(result, items, usage)
            last = "response.incomplete" if body["status"] == "incomplete" else \
                "response.completed"
            yield numbered([*events, {"type": last, "response": body}])
        except Exception as e:  # the engine died or failed: tell the client, end the stream
            api_error = engine_error(e, None)
            error = api_error.message
            yield numbered([{"type": "error", "code": str(api_error.status),
                             "message": api_error.message, "param": api_error.param}])
        finally:
            await gen.aclose()
            log_end([result], error)


def event_bytes(event: dict[str, Any]) -> bytes:
    """One server-sent event: `event: <type>` and its JSON."""
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"
