"""Tokenizers: text <-> token ids, per-token bytes for streaming, and chat templates.

One interface, `Tokenizer`, with three implementations:
- `HFTokenizer`: a checkpoint's tokenizer.json through the `tokenizers` library (not
  transformers, to keep the API process light), with special tokens and the chat template read
  from tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
  generation_config.json.
- `TiktokenTokenizer` (tokenizer_tiktoken.py): a checkpoint's tiktoken.model (Kimi K2,
  Moonlight: no tokenizer.json), with the same special-token and chat-template files.
- `ByteTokenizer`: the built-in tokenizer of presets without tokenizer files. Ids 0-255 are
  bytes; every other id of the vocabulary decodes to a visible placeholder `<|12345|>`.

`token_bytes` gives each id's bytes in context-free form (a byte-level BPE token "Ġhi" is
b" hi"), so the incremental detokenizer can decode a stream exactly, whatever way multi-byte
characters are split over tokens. `load_tokenizer` picks the implementation for a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from moeserve.config import ConfigError
from moeserve.model_config import ModelConfig


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the server need from a tokenizer."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own BOS etc. when add_special_tokens)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; never fails on an id inside the vocabulary."""
        ...

    def token_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> list[bytes]:
        """Each id's bytes (b"" for a skipped special token). Joined and decoded as UTF-8 with
        errors="replace" they give the text of the ids as they appear after a prompt."""
        ...

    chat_template: str | None
    """The checkpoint's chat template (Jinja source); None: the default template."""

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for a chat, ending with the assistant's turn when asked; `tools`
        (OpenAI's tool objects) and `kwargs` (a request's chat_template_kwargs) are variables of
        the template, as transformers passes them."""
        ...

    def max_token_chars(self) -> int:
        """The most characters of text one token can cover (bounds a prompt's length in
        characters by its length in tokens, before tokenizing)."""
        ...

    def non_text_token_ids(self) -> frozenset[int]:
        """Ids inside the vocabulary that never stand for text (special tokens; the byte
        tokenizer's ids past the 256 bytes): a grammar never allows them (structured/)."""
        ...


def _message_text(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of parts ({"type": "text", ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def default_chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> str:
    """The plain format used when a tokenizer has no chat template:
    "<|tools|>\\n[tools as JSON]\\n" when there are tools, "<|role|>\\ncontent\\n" per message,
    then "<|assistant|>\\n". (The chat route writes an assistant message's tool calls into its
    content, in the server's tool-call format, before this runs.)"""
    text = f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
    text += "".join(f"<|{m['role']}|>\n{_message_text(m.get('content'))}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
    """ids 0-255 are the bytes of UTF-8 text; other ids decode to `<|id|>`.

    encode never adds special tokens: the ids are exactly the text's UTF-8 bytes.
    """

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None,
                 pad_token_id: int | None = None) -> None:
        if vocab_size < 256:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 256, got {vocab_size}")
        for name, value in (("bos", bos_token_id), ("eos", eos_token_id), ("pad", pad_token_id)):
            if value is not None and not 0 <= value < vocab_size:
                raise ValueError(f"{name}_token_id {value} outside [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos_token_id is None else (eos_token_id,)
        self.pad_token_id = pad_token_id
        self._special = {i for i in (bos_token_id, eos_token_id, pad_token_id) if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def max_token_chars(self) -> int:
        return 1  # a token is one byte of UTF-8: at most one character

    def non_text_token_ids(self) -> frozenset[int]:
        return frozenset(self._special) | frozenset(range(256, self.vocab_size))

    def token_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> list[bytes]:
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
            if i in self._special:
                out.append(b"" if skip_special_tokens else f"<|{i}|>".encode())
            else:
                out.append(bytes((i,)) if i < 256 else f"<|{i}|>".encode())
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(ids, skip_special_tokens)).decode("utf-8", "replace")

    chat_template: str | None = None

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        return default_chat_template(messages, add_generation_prompt, tools)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_piece(piece: str) -> bytes:
    """As the ByteLevel decoder does it: a piece wholly in the byte alphabet is those bytes;
    any other piece (e.g. an added token "日本") is its own UTF-8."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)
    except KeyError:
        return piece.encode("utf-8")


def _read_json(folder: str, name: str) -> dict[str, Any]:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _piece_decoder(decoder: dict[str, Any] | None) -> Callable[[str], bytes] | None:
    """How a vocabulary piece turns into bytes under tokenizer.json's decoder, for the decoder
    families real checkpoints use; None for others (then each id is decoded on its own)."""
    parts = decoder.get("decoders", []) if decoder and decoder["type"] == "Sequence" else [decoder]
    types = {p["type"] for p in parts if p}
    if "ByteLevel" in types:
        return _byte_level_piece
    if types & {"Metaspace", "ByteFallback", "Replace"}:  # SentencePiece converted: "▁" = " "
        byte_fallback = "ByteFallback" in types

        def sentencepiece(piece: str) -> bytes:
            if byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece[5] == ">":
                return bytes((int(piece[3:5], 16),))
            return piece.replace("\u2581", " ").encode("utf-8")

        return sentencepiece
    return None


class HFTokenizer:
    """A checkpoint's tokenizer.json, with its special tokens and chat template.

    Ids at or past the tokenizer's vocabulary (models pad their embedding) decode to `<|id|>`.
    """

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = os.path.join(folder, "tokenizer.json")
        self.folder = folder
        self._tok = RustTokenizer.from_file(path)
        with open(path, encoding="utf-8") as f:
            self._piece_to_bytes = _piece_decoder(json.load(f).get("decoder"))
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items()
                             if t.special}
        self._cache: dict[int, bytes] = {}
        self._max_token_chars: int | None = None
        special = read_special_tokens(folder, self._tok.token_to_id)
        self.special_tokens = special.names
        self.bos_token_id: int | None = special.bos_token_id
        self.eos_token_ids: tuple[int, ...] = special.eos_token_ids
        self.pad_token_id: int | None = special.pad_token_id
        self.chat_template = read_chat_template(folder)
        self._template: Any = None  # compiled on first use

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def max_token_chars(self) -> int:
        """The longest piece of the vocabulary, added tokens included (a byte-level piece has
        one character per byte: at least the characters it covers)."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(piece) for piece in vocab), default=1)
        return self._max_token_chars

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        _check_ids(ids)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def non_text_token_ids(self) -> frozenset[int]:
        return frozenset(self._special_ids)

    def token_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> list[bytes]:
        _check_ids(ids)
        out = []
        for i in ids:
            if skip_special_tokens and i in self._special_ids:
                out.append(b"")
                continue
            data = self._cache.get(i)
            if data is None:
                data = self._cache[i] = self._bytes_of(i)
            out.append(data)
        return out

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)  # added tokens too: the decoder sees them
        if piece is None:
            return f"<|{token_id}|>".encode()
        if self._piece_to_bytes is None:
            return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return self._piece_to_bytes(piece)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        return render_chat(self, messages, add_generation_prompt, tools, **kwargs)


@dataclass(frozen=True)
class SpecialTokens:
    names: dict[str, str | None]  # bos_token, eos_token, pad_token, unk_token -> text or None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None


def read_special_tokens(folder: str, token_to_id: Callable[[str], int | None]) -> SpecialTokens:
    """bos/eos/pad/unk from tokenizer_config.json over special_tokens_map.json, their ids by
    `token_to_id`; generation_config.json's bos_token_id when the BOS has none, and its
    eos_token_id(s) after the tokenizer's EOS."""
    config = {**_read_json(folder, "special_tokens_map.json"),
              **_read_json(folder, "tokenizer_config.json")}
    generation = _read_json(folder, "generation_config.json")
    names = {name: _token_content(config.get(name))
             for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    ids = {name: token_to_id(text) if text else None for name, text in names.items()}
    gen_bos = _as_id_list(generation.get("bos_token_id"))
    bos = ids["bos_token"] if ids["bos_token"] is not None else (gen_bos[0] if gen_bos else None)
    eos = [ids["eos_token"]] if ids["eos_token"] is not None else []
    eos += [i for i in _as_id_list(generation.get("eos_token_id")) if i not in eos]
    return SpecialTokens(names, bos, tuple(eos), ids["pad_token"])


def _check_ids(ids: Sequence[int]) -> None:
    bad = [i for i in ids if i < 0]
    if bad:
        raise ValueError(f"token id {bad[0]} is negative")


def read_chat_template(folder: str) -> str | None:
    """chat_template.jinja (transformers >= 4.43 writes it), chat_template.json, or the
    tokenizer_config.json field (a string, or a list of named templates: take "default")."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = (_read_json(folder, "chat_template.json").get("chat_template")
                or _read_json(folder, "tokenizer_config.json").get("chat_template"))
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template or None


def _compile_template(source: str) -> Any:
    """Compile the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise RuntimeError("this checkpoint has a chat template, and rendering it needs jinja2: "
                           "pip install jinja2") from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _render(template: Any, **variables: Any) -> str:
    import jinja2

    try:
        return template.render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e


def load_tokenizer(folder: str | None, builtin: str | None, model_config: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer when `folder` has tokenizer.json (HFTokenizer) or else
    tiktoken.model (TiktokenTokenizer), else the built-in one named by `builtin` ("byte": vocab
    size, BOS and the first EOS from `model_config`)."""
    if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder)
    if folder is not None and os.path.isfile(os.path.join(folder, "tiktoken.model")):
        from moeserve.tokenizer_tiktoken import TiktokenTokenizer

        return TiktokenTokenizer(folder)
    if builtin == "byte":
        eos = model_config.eos_token_ids[0] if model_config.eos_token_ids else None
        return ByteTokenizer(model_config.vocab_size, model_config.bos_token_id, eos)
    if builtin is not None:
        raise ConfigError(f"unknown built-in tokenizer {builtin!r} (known: 'byte')")
    where = ("no tokenizer folder was given" if folder is None else
             f"neither tokenizer.json nor tiktoken.model is in {folder!r}")
    raise ConfigError(f"no tokenizer: {where}, and no built-in tokenizer is named; pass a "
                      "folder with tokenizer.json (HF tokenizers) or tiktoken.model (tiktoken, "
                      "with tokenizer_config.json), or use a preset with a built-in tokenizer")


def load_model_tokenizer(model: str, tokenizer: str | None, model_config: ModelConfig
                         ) -> Tokenizer:
    """A served model's tokenizer: the `tokenizer` folder when given, else the model's folder,
    or a preset's built-in tokenizer (the offline LLM, the API processes and the engine's
    structured outputs all load it this way)."""
    folder = tokenizer or (None if model_config.tokenizer else model)
    return load_tokenizer(folder, model_config.tokenizer, model_config)


def render_chat(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    """A checkpoint tokenizer's chat template rendered (compiled on first use into
    `tok._template`), or the default template when the checkpoint has none; shared by the HF
    and the tiktoken tokenizers. `kwargs` are extra template variables; they cannot replace
    the ones set here (messages, tools, add_generation_prompt, the special tokens)."""
    if tok.chat_template is None:
        return default_chat_template(messages, add_generation_prompt, tools)
    if tok._template is None:
        tok._template = _compile_template(tok.chat_template)
    return _render(tok._template, **{**kwargs, **tok.special_tokens}, messages=messages,
                   tools=tools, add_generation_prompt=add_generation_prompt)
