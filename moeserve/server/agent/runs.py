"""A reply's reasoning and content pieces as runs of one kind each, for the APIs that give a
reply as a list of blocks or items (the Messages API's content blocks, the Responses API's
output items): a run opens at its first piece that is not whitespace (whitespace before it is
held, and dropped when a run of another kind comes first) and closes when another kind begins,
a tool call comes, or the reply ends. The streamed and the whole reply go through the same
runs, so they agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from moeserve.server.agent.reply import ReplyPart


@dataclass(frozen=True, slots=True)
class Step:
    action: str  # "open", "text" or "close"
    kind: str  # "reasoning" or "content"
    text: str = ""


class Runs:
    def __init__(self) -> None:
        self.open: str | None = None  # the kind of the run being written
        self._held = ("", "")  # (kind, whitespace) not yet in a run

    def feed(self, kind: str, text: str) -> list[Step]:
        if not text:
            return []
        steps = []
        if self.open != kind:
            if self.open is not None:
                steps += self.close()
            held = self._held[1] if self._held[0] == kind else ""
            if not (held + text).strip():
                self._held = (kind, held + text)
                return steps
            text, self._held = held + text, ("", "")
            self.open = kind
            steps.append(Step("open", kind))
        steps.append(Step("text", kind, text))
        return steps

    def close(self) -> list[Step]:
        """Close the open run (another kind begins, a call comes, or the reply ended)."""
        self._held = ("", "")
        if self.open is None:
            return []
        kind, self.open = self.open, None
        return [Step("close", kind)]


class RunEvents(ABC):
    """A reply's parts -> an API's events: each run's open / text / close steps through
    `_event`, each call through `_call` (after closing the open run). Subclasses keep the whole
    blocks or items they build beside the events."""

    def __init__(self) -> None:
        self._runs = Runs()

    def feed(self, part: ReplyPart) -> list[dict[str, Any]]:
        steps = self._runs.feed("reasoning", part.reasoning)
        steps += self._runs.feed("content", part.content)
        events = [e for step in steps for e in self._event(step)]
        for call in part.calls:
            events += self.close()
            events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open run (`status`: "incomplete" when the reply was cut)."""
        return [e for step in self._runs.close() for e in self._event(step, status)]

    @abstractmethod
    def _event(self, step: Step, status: str = "completed") -> list[dict[str, Any]]:
        """A run's open / text / close step as the API's events."""

    @abstractmethod
    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call, in OpenAI's shape ({"id", "function": {"name", "arguments"}})."""
