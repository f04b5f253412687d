"""A checkpoint's tiktoken tokenizer: Kimi K2 and Moonlight ship `tiktoken.model` (one line per
token: its bytes in base64, then its rank = id) and tokenizer_config.json, and no tokenizer.json;
transformers loads them with remote code (tokenization_kimi.py / tokenization_moonshot.py, class
`TikTokenTokenizer`). `TiktokenTokenizer` does what that class does, without transformers:

  * base vocabulary: the ranks of tiktoken.model, ids 0 .. n-1 (each id once, all 256 single
    bytes among them: byte-level BPE must be able to spell any text);
  * special tokens: ids n .. n + 256 - 1 (NUM_RESERVED_SPECIAL_TOKENS), each named by
    tokenizer_config.json's `added_tokens_decoder` entry of that id, or `<|reserved_token_{id}|>`
    when it has none (Kimi fills the gaps this way). Named ids past that block (the Kimi-Linear
    variant of the class reserves 2 more) extend it;
  * pre-tokenization: Kimi's regex (KIMI_PAT_STR: runs of Han characters split off from other
    letters, case-aware words with English contractions, numbers of up to 3 digits, punctuation
    runs, newlines and other whitespace);
  * encode: special-token text in the input becomes the special id (Kimi's default
    allow_special_tokens=True, as HF tokenizers match added tokens); no BOS/EOS is added. The
    text goes to tiktoken in pieces as Kimi's class cuts it: 400,000 characters at most, and no
    run of whitespace or of non-whitespace longer than 25,000 (tiktoken's regex is very slow on
    longer runs: openai/tiktoken#195);
  * bos/eos/pad/unk, generation_config.json's EOS ids and the chat template: as HFTokenizer reads
    them (tokenizer.py's read_special_tokens and read_chat_template).

Decoding goes through each id's bytes (`token_bytes`), which is all the incremental detokenizer
needs: a base token's bytes are its tiktoken.model bytes (possibly part of a UTF-8 character), a
special token's its name, an id at or past the vocabulary (embedding padding) `<|id|>`.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from moeserve.tokenizer import (
    _check_ids,
    _read_json,
    _token_content,
    read_chat_template,
    read_special_tokens,
    render_chat,
)

NUM_RESERVED_SPECIAL_TOKENS = 256
"""Special ids after the base vocabulary (Kimi's num_reserved_special_tokens)."""

# Kimi's pat_str (tokenization_kimi.py), one alternative per line
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

MAX_ENCODE_CHARS = 400_000
"""Characters per tiktoken call at most (longer ones can panic in tiktoken)."""
MAX_RUN_CHARS = 25_000
"""Longest run of whitespace or of non-whitespace given to tiktoken in one piece."""

# Python's \s (str patterns) is exactly str.isspace(), the test Kimi's splitter uses
_RUN = re.compile(r"\s+|\S+")


def split_for_encoding(text: str) -> Iterator[str]:
    """The pieces Kimi's class encodes one by one: chunks of MAX_ENCODE_CHARS characters, each
    cut so that no run of whitespace / non-whitespace is longer than MAX_RUN_CHARS (a long run is
    cut every MAX_RUN_CHARS characters from its start). Joined, the pieces are `text`."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start:start + MAX_ENCODE_CHARS]
        cut = 0
        for run in _RUN.finditer(chunk):
            begin, end = run.span()
            if end - begin <= MAX_RUN_CHARS:
                continue
            for pos in range(begin + MAX_RUN_CHARS, end, MAX_RUN_CHARS):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """tiktoken.model -> {token bytes: rank}. Checks that the ranks are 0 .. n-1, each once, and
    that every single byte is a token. (Not tiktoken.load.load_tiktoken_bpe: that one caches
    files by path in a temp folder, so a changed file at the same path can read stale.)"""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                if len(fields) != 2:
                    raise ValueError("not two fields")
                ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
            except (ValueError, binascii.Error) as e:
                raise ValueError(f"{path}:{line_no}: expected '<base64 token> <rank>' ({e})") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0 .. {len(ranks) - 1} with each token and "
                         "each rank once")
    missing = [b for b in range(256) if bytes((b,)) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes are not tokens (first: "
                         f"{missing[0]:#04x}); byte-level BPE needs all 256")
    return ranks


def special_tokens(num_base: int, added_tokens_decoder: dict[str, Any]
                   ) -> dict[int, tuple[str, bool]]:
    """id -> (text, special) for the ids after the base vocabulary: NUM_RESERVED_SPECIAL_TOKENS
    of them (more when added_tokens_decoder names a later id), named by added_tokens_decoder
    ({"163584": {"content": "[BOS]", "special": true, ...}}) or `<|reserved_token_{id}|>`.
    Entries for ids inside the base vocabulary are ignored, as Kimi's class does."""
    named: dict[int, tuple[str, bool]] = {}
    for key, entry in added_tokens_decoder.items():
        content = _token_content(entry)
        if content is None:
            raise ValueError(f"added_tokens_decoder[{key!r}] has no content")
        special = entry.get("special", True) if isinstance(entry, dict) else True
        named[int(key)] = (content, bool(special))
    end = max([num_base + NUM_RESERVED_SPECIAL_TOKENS, *(i + 1 for i in named)])
    tokens = {i: named.get(i, (f"<|reserved_token_{i}|>", True)) for i in range(num_base, end)}
    seen: dict[str, int] = {}
    for i, (text, _) in tokens.items():
        if text in seen:
            raise ValueError(f"special tokens {seen[text]} and {i} are both {text!r}")
        seen[text] = i
    return tokens


class TiktokenTokenizer:
    """A checkpoint folder's tiktoken.model with its tokenizer_config.json (see the module
    docstring). Needs the `tiktoken` package."""

    def __init__(self, folder: str) -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise RuntimeError(f"{folder!r} has a tiktoken tokenizer (tiktoken.model, no "
                               "tokenizer.json); loading it needs the tiktoken package: "
                               "pip install tiktoken") from e
        self.folder = folder
        ranks = read_tiktoken_ranks(os.path.join(folder, "tiktoken.model"))
        config = _read_json(folder, "tokenizer_config.json")
        specials = special_tokens(len(ranks), config.get("added_tokens_decoder") or {})
        self._special_by_text = {text: i for i, (text, _) in specials.items()}
        self._enc = tiktoken.Encoding(name=f"moeserve:{os.path.abspath(folder)}",
                                      pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self._special_by_text)
        self.vocab_size: int = len(ranks) + len(specials)
        self._bytes: list[bytes] = [b""] * self.vocab_size  # id -> its bytes
        for token, rank in ranks.items():
            self._bytes[rank] = token
        for i, (text, _) in specials.items():
            self._bytes[i] = text.encode("utf-8")
        self._special_ids = frozenset(i for i, (_, special) in specials.items() if special)
        self._max_token_chars = max(len(b) for b in self._bytes)
        self._ranks = ranks
        special = read_special_tokens(folder, self._token_to_id)
        self.special_tokens = special.names
        self.bos_token_id: int | None = special.bos_token_id
        self.eos_token_ids: tuple[int, ...] = special.eos_token_ids
        self.pad_token_id: int | None = special.pad_token_id
        self.chat_template = read_chat_template(folder)
        self._template: Any = None  # compiled on first use

    def _token_to_id(self, text: str) -> int | None:
        """A special token's id, or the base token spelled by `text`'s UTF-8; None if neither."""
        i = self._special_by_text.get(text)
        return i if i is not None else self._ranks.get(text.encode("utf-8"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text becomes its id. `add_special_tokens` adds
        nothing: Kimi's tokenizer adds no BOS/EOS (its chat template writes the markers)."""
        ids: list[int] = []
        for piece in split_for_encoding(text):
            ids += self._enc.encode(piece, allowed_special="all")
        return ids

    def non_text_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def max_token_chars(self) -> int:
        """The longest token in bytes (special names included): a token covers at most one
        character per byte."""
        return self._max_token_chars

    def token_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> list[bytes]:
        _check_ids(ids)
        out = []
        for i in ids:
            if i >= self.vocab_size:
                out.append(f"<|{i}|>".encode())
            elif skip_special_tokens and i in self._special_ids:
                out.append(b"")
            else:
                out.append(self._bytes[i])
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(ids, skip_special_tokens)).decode("utf-8", "replace")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        return render_chat(self, messages, add_generation_prompt, tools, **kwargs)
