"""What a request may cost the API process before it is tokenized, checked before any tokenization
so that no one request blocks the event loop every other stream and /health share.

    body bytes > MAX_BODY_BYTES                      413, while reading (serving.read_body)
    body >= BIG_BODY_BYTES: in a worker thread, the prompt or messages array's elements are
        counted on its raw bytes (numpy, which releases the GIL: no Python object per element),
        then decoded only when within the limits, and the checks below run; all before the
        strict pydantic parse, whose cost grows with the body's JSON values (4M one-word
        prompts: 2 s of the loop; the count takes 0.1 s off it)
    prompts x n > MAX_CHOICES                        400 "n"
    a text prompt longer than max_prompt_chars       400 "prompt": it cannot fit in
        max_model_len tokens (no token covers more than `max_token_chars` characters; the
        bound has a margin of 2 for normalizers that shrink text)
    chat: more messages than max_model_len, or more content characters than max_prompt_chars
                                                     400 "messages"
    a token-id prompt of max_model_len ids or more   400 "prompt" (its length is checked before
        its ids are scanned)

Text longer than THREAD_TOKENIZE_CHARS in all is tokenized (chat: rendered too) off the event
loop, in one worker-thread call per request (`tokenize_off_loop_if_large`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import numpy as np

from moeserve.server.errors import APIError
from moeserve.server.protocol import MAX_CHOICES

MAX_BODY_BYTES = 64 << 20
BIG_BODY_BYTES = 1 << 20
THREAD_TOKENIZE_CHARS = 16384
_CHARS_MARGIN = 2
T = TypeVar("T")


class _Shape(msgspec.Struct, forbid_unknown_fields=False):
    """The fields the limits read, left raw (the pydantic parse follows)."""

    prompt: msgspec.Raw = msgspec.Raw(b"null")
    messages: msgspec.Raw = msgspec.Raw(b"null")
    n: Any = 1


async def tokenize_off_loop_if_large(num_chars: int, tokenize: Callable[[], T]) -> T:
    """`tokenize()`, in a worker thread when it covers more than THREAD_TOKENIZE_CHARS."""
    if num_chars > THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(tokenize)
    return tokenize()


def max_prompt_chars(max_model_len: int, max_token_chars: int) -> int:
    """More characters than this cannot be max_model_len tokens or fewer."""
    return max_model_len * max(1, max_token_chars) * _CHARS_MARGIN


async def precheck_body(body: bytes, max_model_len: int, max_chars: int) -> None:
    """For a big body: apply the limits off the loop (APIError 400; see module doc). A body
    that does not decode is left to the strict parse, which names its problem."""
    if len(body) >= BIG_BODY_BYTES:
        await asyncio.to_thread(_precheck, body, max_model_len, max_chars)


def _precheck(body: bytes, max_model_len: int, max_chars: int) -> None:
    try:
        shape = msgspec.json.decode(body, type=_Shape)
        n = shape.n if isinstance(shape.n, int) and not isinstance(shape.n, bool) else 1
        if bytes(shape.prompt) != b"null":
            raw = bytes(shape.prompt)
            _check_prompt_count(raw, n, max_model_len)  # before decoding the elements
            check_prompt(msgspec.json.decode(raw), n, max_model_len, max_chars)
        if bytes(shape.messages) != b"null":
            raw = bytes(shape.messages)
            if _more_elements_than(raw, max_model_len):
                raise _too_many_messages(count_array_elements(raw), max_model_len)
            messages = msgspec.json.decode(raw)
            if isinstance(messages, list):
                check_messages([_content_chars(m) for m in messages], max_model_len, max_chars)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return


def _check_prompt_count(raw: bytes, n: int, max_model_len: int) -> None:
    """A prompt array with more elements than any valid one: token ids (its first element a
    number) up to max_model_len - 1, else prompts x n up to MAX_CHOICES."""
    first = raw[1:64].lstrip()[:1] if raw[:1] == b"[" else b""
    ids = first != b"" and first in b"-0123456789"
    limit = max_model_len - 1 if ids else MAX_CHOICES // max(1, n)
    if _more_elements_than(raw, limit):
        count = count_array_elements(raw)
        raise _too_many_ids("", count, max_model_len) if ids else _too_many_choices(count, n)


def _more_elements_than(raw: bytes, limit: int) -> bool:
    """Cheap first: an array cannot have more elements than commas + 1."""
    return raw.count(b",") >= limit and count_array_elements(raw) > limit


def _too_many_choices(count: int, n: int) -> APIError:
    return APIError(400, f"n x number of prompts is {count * n}; the limit is {MAX_CHOICES}",
                    "n")


def _too_many_ids(where: str, count: int, max_model_len: int) -> APIError:
    return APIError(400, f"prompt: {where}the prompt has {count} tokens; max_model_len is "
                    f"{max_model_len}, so a prompt may have at most {max_model_len - 1}",
                    "prompt")


def _too_many_messages(count: int, max_model_len: int) -> APIError:
    return APIError(400, f"messages: {count} messages cannot fit in max_model_len "
                    f"{max_model_len} tokens", "messages")


def check_prompt(prompt: Any, n: int, max_model_len: int, max_chars: int,
                 truncated: bool = False) -> None:
    """The completions prompt field: a string, a list of token ids, a list of strings or a list
    of token-id lists (other shapes are the strict parse's to refuse). `truncated`
    (truncate_prompt_tokens): token-id prompts may be longer than max_model_len; text stays
    within what tokenization takes."""
    prompts = [prompt] if isinstance(prompt, str) or not isinstance(prompt, list) or (
        prompt and isinstance(prompt[0], int)) else prompt
    if len(prompts) * n > MAX_CHOICES:
        raise _too_many_choices(len(prompts), n)
    for i, p in enumerate(prompts):
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        if isinstance(p, str) and len(p) > max_chars:
            raise APIError(400, f"prompt: {where}the text has {len(p)} characters, more than "
                           f"max_model_len {max_model_len} tokens can hold (at most "
                           f"{max_chars} characters are tokenized)", "prompt")
        if isinstance(p, list) and len(p) >= max_model_len and not truncated:
            raise _too_many_ids(where, len(p), max_model_len)


def check_messages(content_chars: list[int], max_model_len: int, max_chars: int) -> None:
    """Chat messages, given each one's content length in characters."""
    if len(content_chars) > max_model_len:
        raise _too_many_messages(len(content_chars), max_model_len)
    total = sum(content_chars)
    if total > max_chars:
        raise APIError(400, f"messages: the contents have {total} characters, more than "
                       f"max_model_len {max_model_len} tokens can hold (at most {max_chars} "
                       "characters are rendered)", "messages")


def _content_chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text", "")) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0


def count_array_elements(raw: bytes) -> int:
    """The elements of the JSON array `raw` at its top level (0 when `raw` is not an array),
    from its bytes: commas outside strings at depth 1, plus one. No Python object per element.
    """
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size < 2 or b[0] != ord("["):
        return 0
    quote = b == ord('"')
    backslash = b == ord("\\")
    if backslash.any():  # a quote is escaped when an odd run of backslashes precedes it
        pos = np.arange(b.size, dtype=np.int64)
        last_plain = np.maximum.accumulate(np.where(backslash, -1, pos))  # [N]
        run = np.empty_like(pos)
        run[0] = 0
        np.subtract(pos[1:] - 1, last_plain[:-1], out=run[1:])  # backslashes before each byte
        quote &= (run & 1) == 0
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0  # a closing quote counts as out
    step = np.zeros(b.size, dtype=np.int8)
    step[(b == ord("[")) | (b == ord("{"))] = 1
    step[(b == ord("]")) | (b == ord("}"))] = -1
    step[~outside] = 0
    depth = np.cumsum(step, dtype=np.int32)  # after each byte
    commas = int(np.count_nonzero((b == ord(",")) & outside & (depth == 1)))
    empty = raw[1:].lstrip()[:1] == b"]"
    return 0 if empty else commas + 1
