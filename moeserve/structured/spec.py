"""What a request's output is held to: `StructuredOutput`, and its llguidance grammar.

Torch-free and llguidance-free at import: it rides in SamplingParams (types.py) from the API
process to the engine. `check()` builds the grammar and validates it without a tokenizer (no
vocabulary needed), so the API process refuses a bad schema or regex with a 400 before the
request reaches the engine; the engine compiles it against the vocabulary (grammars.py).

    kind          spec                                  the output is
    json_schema   a JSON schema (an object), as text    a JSON value valid under it
    json_object   ""                                    a JSON object
    regex         a pattern (Rust regex syntax)         a full match of it
    choice        a JSON list of strings, as text       exactly one of them
    grammar       a Lark grammar (llguidance's dialect) a sentence of it

JSON is written compact, no whitespace between its tokens (json.dumps with separators "," and
":"; llguidance's `whitespace_flexible` off): a model cannot pad the
output with whitespace until max_tokens, a known failure of JSON modes that allow any.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1_000_000  # a schema of 256 tools with their parameters stays far below
MAX_CHOICES = 4_096
JSON_OBJECT_SCHEMA = '{"type": "object"}'
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A request's output constraint; raises ValueError naming what is wrong."""

    kind: str
    spec: str = ""
    start_after: int | None = None
    """The grammar holds from the token after this id (a reasoning model's end-of-thinking
    token, when the reply starts inside its reasoning); None: from the first token."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}; got "
                             f"{self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"the {self.kind} of a structured output must be text, got "
                             f"{type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} of a structured output has {len(self.spec):,} "
                             f"characters; at most {MAX_SPEC_CHARS:,} are accepted")
        if self.kind == "json_object" and self.spec:
            raise ValueError("a json_object structured output takes no spec")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise ValueError(f"the {self.kind} of a structured output is empty")
        if self.kind == "json_schema":
            _schema_object(self.spec)
        if self.kind == "choice":
            _choices(self.spec)
        if self.start_after is not None and (not isinstance(self.start_after, int)
                                             or self.start_after < 0):
            raise ValueError(f"start_after must be a token id >= 0, got {self.start_after!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> StructuredOutput:
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(options, ensure_ascii=False))

    def grammar(self) -> str:
        """The llguidance grammar text (not yet validated: `check` does)."""
        return _grammar(self.kind, self.spec)

    def check(self) -> str:
        """The grammar, validated without a vocabulary; ValueError with llguidance's message."""
        grammar = self.grammar()
        message = _validation_error(grammar)
        if message:
            raise ValueError(f"the {self.kind} of the structured output is not valid: "
                             f"{message.strip()}")
        return grammar


# An agent's requests repeat their schemas: the grammar text and its check are kept for the 64
# most recent (a regex of 128 repeats cost 0.1 + 0.45 ms a request, in the API process and
# again in the engine's intake).
@functools.lru_cache(maxsize=64)
def _grammar(kind: str, spec: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":  # JSON string literals are Lark string literals
        # NOTE: one terminal (upper case: a lexeme, matched by the lexer's automaton), not
        # one rule per choice: llguidance's Earley rows hold at most 2,000 items, which
        # thousands of alternatives of a rule exceed at the first token.
        options = dict.fromkeys(_choices(spec))
        return LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in options))
    return LLMatcher.grammar_from_lark(spec)


@functools.lru_cache(maxsize=64)
def _validation_error(grammar: str) -> str:
    """llguidance's message for a grammar it refuses; "" for a valid one."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar) or ""


def _schema_object(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the json_schema of a structured output is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return schema


def _choices(text: str) -> list[str]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the choices of a structured output are not JSON: {e}") from None
    if not isinstance(options, list) or not options:
        raise ValueError("choice needs a non-empty list of strings")
    if len(options) > MAX_CHOICES:
        raise ValueError(f"choice has {len(options):,} strings; at most {MAX_CHOICES:,}")
    for option in options:
        if not isinstance(option, str) or not option:
            raise ValueError(f"every choice must be a non-empty string, got {option!r}")
    return options
