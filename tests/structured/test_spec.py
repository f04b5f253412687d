"""StructuredOutput: each kind's form checked at construction, the grammar validated without a
vocabulary (what the API process runs before a request reaches the engine)."""

from __future__ import annotations

import json

import pytest

from moeserve.structured.spec import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutput
from moeserve.types import SamplingParams


@pytest.mark.parametrize("kind, spec, message", [
    ("yaml", "", "kind must be one of"),
    ("json_schema", "{", "not JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("json_object", "{}", "takes no spec"),
    ("regex", "", "is empty"),
    ("grammar", "", "is empty"),
    ("choice", "[]", "non-empty list"),
    ("choice", '"yes"', "non-empty list"),
    ("choice", '["yes", 3]', "non-empty string, got 3"),
    ("choice", '["yes", ""]', "non-empty string, got ''"),
    ("choice", json.dumps(["x"] * (MAX_CHOICES + 1)), "at most"),
    ("regex", "a" * (MAX_SPEC_CHARS + 1), "at most 1,000,000 are accepted"),
])
def test_a_malformed_spec_is_refused_by_name(kind: str, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(kind, spec)


def test_start_after_must_be_a_token_id() -> None:
    with pytest.raises(ValueError, match="start_after must be a token id"):
        StructuredOutput("json_object", start_after=-1)


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("regex", "a["), "invalid regex"),
    (StructuredOutput.json_schema({"type": "foo"}), "Invalid type: foo"),
    (StructuredOutput("grammar", "start: missing_rule"), "unknown name"),
])
def test_check_names_what_llguidance_refuses(structured: StructuredOutput, message: str) -> None:
    with pytest.raises(ValueError, match=f"not valid: .*{message}"):
        structured.check()


@pytest.mark.parametrize("structured", [
    StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutput("json_object"),
    StructuredOutput("regex", r"\d{3}"),
    StructuredOutput.choice(['say "hi"', "ünïcode\n", "back\\slash"]),
    StructuredOutput("grammar", 'start: "a" b\nb: "b"+'),
])
def test_every_kind_gives_a_valid_grammar(structured: StructuredOutput) -> None:
    assert structured.check()


def test_sampling_params_take_only_a_structured_output() -> None:
    with pytest.raises(ValueError, match="structured must be a StructuredOutput, got dict"):
        SamplingParams(structured={"kind": "regex"})  # type: ignore[arg-type]
