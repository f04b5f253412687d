"""tool_choice "required" or a named function: the reply is held to a JSON grammar of calls,
then read back as tool calls (vLLM's approach; the model writes JSON, not its own call format).

    named {"function": {"name": "f"}}  the reply is f's arguments: an object valid under f's
                                       parameters -> one call of f; finish_reason as the engine's
    "required"                         the reply is [{"name": ..., "parameters": {...}}, ...]
                                       (one item or more; one only without parallel_tool_calls),
                                       each item a function offered with its parameters ->
                                       those calls; finish_reason "tool_calls"

The calls are released whole when the reply ends, as the auto path releases each call. A reply
that does not parse (cut by max_tokens) is given back as content, as the model wrote it.
"""

from __future__ import annotations

import json
from typing import Any

from moeserve.server.agent.protocol import NamedToolChoice, Tool
from moeserve.server.agent.tool_splitter import ParsedCall
from moeserve.structured.spec import StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def forced_output(tools: list[Tool], choice: NamedToolChoice | str,
                  parallel: bool) -> StructuredOutput:
    """The grammar of a forced reply (the module docstring)."""
    if isinstance(choice, NamedToolChoice):
        [tool] = [t for t in tools if t.function.name == choice.function.name]
        return StructuredOutput.json_schema(tool.function.parameters or ANY_OBJECT)
    items = [{"type": "object", "additionalProperties": False,
              "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name},
                             "parameters": t.function.parameters or ANY_OBJECT}}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema)


class ForcedCallSplitter:
    """ToolCallSplitter's interface for a forced reply: the content is held until the reply
    ends, then read as calls (or given back as content when it does not parse)."""

    def __init__(self, choice: NamedToolChoice | str) -> None:
        self.name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.num_calls = 0
        self._text = ""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._text += text
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        text, self._text = self._text, ""
        calls = self._calls(text)
        if calls is None:
            return text, []
        self.num_calls += len(calls)
        return "", calls

    def _calls(self, text: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:
            return [ParsedCall(self.name, value)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("parameters"), dict)):
                return None
            calls.append(ParsedCall(item["name"], item["parameters"]))
        return calls
