"""The tool-call splitter: a reply's content -> text and the tool calls the model wrote, in a
family's format (tool_formats.py), incrementally, the same for any chunking of the text.

    "Let me look.\\n<tool_call>\\n{...}\\n</tool_call>" -> content "Let me look.", one call

A format names the marker that opens a block of calls and the one that closes it (None: the
block runs to the end of the reply, as Mistral's does). Text outside blocks is content; the
whitespace before a block that parses, and whitespace-only text after the first call, is
dropped. A closed
block is parsed at once and its calls released whole (name and all arguments in one delta, which
OpenAI's streaming shape allows); a block that does not parse, or names a function the request
did not offer, is given back as content, as the model wrote it, so nothing is lost.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from moeserve.detokenizer import marker_prefix_len


class ToolCallError(ValueError):
    """A block of tool calls that does not parse."""


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None
    """The model's own id for the call (Kimi K2 writes one); None: the server makes one."""


class ToolFormat(Protocol):
    """How a family writes tool calls (tool_formats.py holds them)."""

    name: str
    start: str
    end: str | None
    markers: tuple[str, ...]
    """Every marker the format writes (they must survive detokenization)."""

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        """The calls of the text between `start` and `end`; `tools` maps each offered
        function's name to its JSON-schema parameters. Raises ToolCallError."""
        ...

    def render(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """Calls written as the model writes them, block markers included (the default chat
        template uses it for an assistant message's tool_calls)."""
        ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallSplitter:
    """Feed it a reply's content deltas; each call returns (content, calls) it can release."""

    def __init__(self, fmt: ToolFormat, tools: Mapping[str, dict[str, Any]],
                 parallel: bool = True) -> None:
        self.fmt = fmt
        self.tools = tools
        self.parallel = parallel
        self.num_calls = 0
        self._inside = False
        self._buffer = ""
        self._gap = ""  # the whitespace before the open block: content if the block fails
        self._scanned = 0  # the open block's text before this holds no end marker

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = "", []
        while True:
            if self._inside:
                end = self.fmt.end
                # search only where the end marker can newly complete (a long block is
                # searched once, not once per delta)
                at = -1 if end is None else self._buffer.find(end, self._scanned)
                if at < 0:
                    self._scanned = max(0, len(self._buffer) - len(end or ""))
                    return content, calls
                self._scanned = 0
                block, self._buffer = self._buffer[:at], self._buffer[at + len(end or ""):]
                self._inside = False
                content += self._close(block, end or "", calls)
                continue
            at = self._buffer.find(self.fmt.start)
            if at >= 0:
                before = self._buffer[:at].rstrip()
                content += self._content(before)
                self._gap = self._buffer[len(before):at]
                self._buffer = self._buffer[at + len(self.fmt.start):]
                self._inside = True
                continue
            # release all but a possible marker's start and the trailing whitespace
            keep = len(self._buffer) - marker_prefix_len(self._buffer, (self.fmt.start,))
            ready = self._buffer[:keep].rstrip()
            content += self._content(ready)
            self._buffer = self._buffer[len(ready):]
            return content, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the reply: an open block is parsed as it stands (Mistral's never
        closes); what is held outside one is content."""
        if self._inside:
            self._inside = False
            calls: list[ParsedCall] = []
            block, self._buffer = self._buffer, ""
            return self._close(block, "", calls), calls
        rest, self._buffer = self._buffer, ""
        return self._content(rest), []

    def _content(self, text: str) -> str:
        """Text outside blocks; after a call, whitespace alone is dropped."""
        return text if self.num_calls == 0 or text.strip() else ""

    def _close(self, block: str, end: str, calls: list[ParsedCall]) -> str:
        """Parse a block into `calls`; a block that fails comes back as content."""
        try:
            parsed = self.fmt.parse(block, self.tools)
            unknown = [c.name for c in parsed if c.name not in self.tools]
            if unknown:
                raise ToolCallError(f"no function {unknown[0]!r} was offered")
            if not parsed:
                raise ToolCallError("no call in the block")
        except ToolCallError:
            return self._gap + self.fmt.start + block + end
        if not self.parallel:
            parsed = parsed[:max(0, 1 - self.num_calls)]
        self.num_calls += len(parsed)
        calls += parsed
        return ""
