"""A reply's reasoning and content pieces as runs of one kind each, for the APIs that give a
reply as a list of blocks or items (the Messages API's content blocks, the Responses API's
output items): a run opens at its first piece that is not whitespace (whitespace before it is
held, and dropped when a run of another kind comes first) and closes when another kind begins,
a tool call comes, or the reply ends. The streamed and the whole reply go through the same
runs, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass


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
