"""One reply's text -> its reasoning, its content and its tool calls, incrementally: the
reasoning splitter first (reasoning.py), then the tool-call splitter over what is content
(tool_splitter.py), so a call written inside the reasoning stays reasoning. The chat route
keeps one per choice; streamed and whole replies go through the same code, so the deltas of a
stream join up to the whole reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from moeserve.server.agent.forced_calls import ForcedCallSplitter
from moeserve.server.agent.reasoning import ReasoningSplitter
from moeserve.server.agent.tool_splitter import ParsedCall, ToolCallSplitter, new_call_id


@dataclass(slots=True)
class ReplyPart:
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    """Tool calls in OpenAI's shape ({"id", "type", "function": {"name", "arguments"}})."""


class ReplyParser:
    def __init__(self, reasoning: ReasoningSplitter | None,
                 tools: ToolCallSplitter | ForcedCallSplitter | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> ReplyPart:
        """The parts of `text` that are decided; `final`: the reply ends with it."""
        part = ReplyPart()
        part.reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning is not None:
            rest_reasoning, rest = self.reasoning.finish()
            part.reasoning += rest_reasoning
            content += rest
        if self.tools is None:
            part.content = content
            return part
        part.content, calls = self.tools.feed(content)
        if final:
            rest, more = self.tools.finish()
            part.content += rest
            calls += more
        part.calls = [_openai_call(c) for c in calls]
        return part


def reply_part(parser: ReplyParser | None, text: str, final: bool) -> ReplyPart:
    """`text` through the reply's parser; all content when the reply is not parsed."""
    return parser.feed(text, final=final) if parser is not None else ReplyPart(content=text)


def _openai_call(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id or new_call_id(), "type": "function",
            "function": {"name": call.name,
                         "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
