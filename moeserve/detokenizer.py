"""Incremental detokenization of one request's output, with stop strings.

Token ids -> bytes (`Tokenizer.token_bytes`) -> an incremental UTF-8 decoder -> text. The decoder
keeps the bytes of a character that is still incomplete, so a character split over tokens is
emitted once, whole, and never as U+FFFD; bytes that can never form a character become U+FFFD
exactly as a one-shot `bytes.decode("utf-8", "replace")` would make them.

Stop strings are searched in the accumulated text. While streaming, the tail of the text that
could be the start of a stop string (the longest tail that is a proper prefix of one: at most
max(len(stop)) - 1 characters) is held back; when a stop string is found the text is cut before
it (after it, with `include_stop`) and nothing more is emitted; `flush()` releases what is held
at the end of the request.
With `min_tokens` M, a stop string counts only if it ends in the text of the (M+1)-th token or a
later one (it may begin earlier), as vLLM's min_tokens holds stop strings.

    text:   | emitted ........................ | held back (a stop's prefix) |
            0                             num_emitted                    len(text)
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from moeserve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; token bytes are context-free, so it is kept only for
            reference (the output text is the text the output ids add after the prompt).
        skip_special_tokens: drop special tokens (EOS, ...) from the text.
        stop: strings that end the output; the text is cut before the first one to complete.
        min_tokens: a stop string must end in the text of a later token than the first
            min_tokens ones.
        include_stop: the text keeps the stop string that ended it (cut after it, not before).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stop_hit: str | None = None
        """The stop string that ended the text, once one has."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._text = ""
        self._num_emitted = 0
        self._finished = False
        self._include_stop = include_stop
        self._tokens_to_hold = min_tokens  # tokens still to come before a stop may complete
        self._stop_end_after = 0  # a stop must end past this many characters of text

    @property
    def text(self) -> str:
        """The output text so far (cut before the stop string), held-back characters included."""
        return self._text

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Decode the new tokens; return the text that can be emitted now ("" once stopped)."""
        if self.stop_hit is not None or self._finished:
            return ""
        if self._tokens_to_hold > 0:  # min_tokens: these tokens' text cannot end a stop
            held, new_token_ids = new_token_ids[:self._tokens_to_hold], \
                new_token_ids[self._tokens_to_hold:]
            self._tokens_to_hold -= len(held)
            self._text += self._decode(held)
            self._stop_end_after = len(self._text)
        self._append(self._decode(new_token_ids))
        return self._release(final=self.stop_hit is not None)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(
            b"".join(self.tokenizer.token_bytes(token_ids, self.skip_special_tokens)))

    def flush(self) -> str:
        """End of the output: decode any incomplete trailing bytes (as U+FFFD) and return all
        the text still held back. Later adds return ""."""
        if self._finished:
            return ""
        if self.stop_hit is None:
            self._append(self._decoder.decode(b"", final=True))
        self._finished = True
        return self._release(final=True)

    def _append(self, new_text: str) -> None:
        """Extend the text; on stop strings, cut before the one that ends first (the earliest
        starting one on a tie), so the result does not depend on how tokens were chunked."""
        self._text += new_text
        if not self.stop or not new_text:
            return
        # A new occurrence must end in new_text, so it starts in the held-back tail at the
        # earliest (an earlier start would have been complete, and found, before); under
        # min_tokens it must also end past the held tokens' text.
        start, after = self._num_emitted, self._stop_end_after
        found = [(pos + len(s), pos, i) for i, s in enumerate(self.stop)
                 if (pos := self._text.find(s, max(start, after - len(s) + 1))) >= 0]
        if found:  # the stop completed first, as token-by-token streaming would see it
            end, pos, i = min(found)
            self._text = self._text[:end if self._include_stop else pos]
            self.stop_hit = self.stop[i]

    def _release(self, final: bool) -> str:
        held = marker_prefix_len(self._text, self.stop, self._max_held)
        end = len(self._text) if final else max(self._num_emitted, len(self._text) - held)
        delta = self._text[self._num_emitted:end]
        self._num_emitted = end
        return delta


def marker_prefix_len(text: str, markers: Sequence[str], longest: int | None = None) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers` (at most
    `longest` characters, default the longest marker's length - 1): what a stream must hold
    back until it knows whether a marker follows."""
    if longest is None:
        longest = max((len(m) for m in markers), default=1) - 1
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0
