"""The reasoning splitter: a reply's text -> its reasoning (between <think> and </think>) and its
content (the rest), incrementally, the same for any chunking of the text.

    "<think>\\nweigh it...\\n</think>\\n\\nThe answer." -> reasoning "weigh it...\\n",
                                                         content "The answer."

The reply starts inside the reasoning when the prompt ends with the start marker (DeepSeek-R1's
and GLM's templates open it for the model); otherwise a reply that starts with the start marker
(after whitespace) enters it, and one that starts with anything else is content throughout. The
reasoning ends at the first end marker; a reply cut off before it is all reasoning. Whitespace
right after either marker is dropped. Markers are text, so a tokenizer that holds them as
special tokens must keep them in the text (`skip_special_tokens=False`, which chat.py sets).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.detokenizer import marker_prefix_len

_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A family's reasoning markers, by the names vLLM's and SGLang's --reasoning-parser use."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether the template opened the reasoning at the end of the prompt."""
        return prompt_text.rstrip().endswith(self.start)


class ReasoningSplitter:
    """Feed it a reply's text deltas; each call returns the (reasoning, content) it can release.

    A tail that could begin a marker is held until the next delta or `finish()` decides it.
    """

    def __init__(self, fmt: ReasoningFormat, starts_inside: bool) -> None:
        self.fmt = fmt
        self._state = _REASONING if starts_inside else _BEFORE
        self._buffer = ""
        self._strip = True  # drop whitespace at the start of the current part

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        while True:
            if self._state == _BEFORE:
                rest = self._buffer.lstrip()
                if rest.startswith(self.fmt.start):
                    self._buffer, self._state, self._strip = (
                        rest[len(self.fmt.start):], _REASONING, True)
                    continue
                if not rest or self.fmt.start.startswith(rest):
                    return reasoning, content  # not decided yet
                self._state, self._strip = _CONTENT, False
                continue
            if self._strip:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    return reasoning, content
                self._strip = False
            if self._state == _CONTENT:
                content += self._buffer
                self._buffer = ""
                return reasoning, content
            at = self._buffer.find(self.fmt.end)
            if at >= 0:
                reasoning += self._buffer[:at]
                self._buffer = self._buffer[at + len(self.fmt.end):]
                self._state, self._strip = _CONTENT, True
                continue
            keep = marker_prefix_len(self._buffer, (self.fmt.end,))
            reasoning += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the reply: what is still held, in the part it belongs to."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == _REASONING else ("", rest)
