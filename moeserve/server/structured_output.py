"""The request fields that hold a reply to a format, and the StructuredOutput they make.

    response_format     OpenAI's: {"type": "text"} (no constraint), {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name", "schema", ...}}
    structured_outputs  vLLM's (moeserve extension): exactly one of "json" (a schema),
                        "json_object" (true), "regex", "choice" (strings), "grammar" (Lark)

Both are taken by /v1/completions and /v1/chat/completions; at most one of them per request,
and not beside tools unless tool_choice is "none" (protocol.py's checks): a forced call
(tool_choice "required" or named) is a grammar too, server/agent/forced_calls.py. `strict` is
accepted either way: the schema is always enforced. The grammar is checked here, in the API
process, so a bad one is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moeserve.server.errors import APIError
from moeserve.structured.spec import MAX_CHOICES, StructuredOutput

MAX_SCHEMA_NAME = 64


class _Field(BaseModel):
    # NOTE: the attribute docstrings become the fields' descriptions in /openapi.json
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True,
                              populate_by_name=True)


class JsonSchemaFormat(_Field):
    name: Annotated[str, Field(min_length=1, max_length=MAX_SCHEMA_NAME,
                               pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    """The JSON schema the reply is held to; absent: any JSON value."""
    strict: bool | None = None
    """Accepted either way: moeserve always enforces the schema."""


def _given(field: str, json_type: str | list[str]) -> dict[str, Any]:
    """JSON Schema: `field` is present and not null (of its non-null types)."""
    return {"required": [field], "properties": {field: {"type": json_type}}}


class ResponseFormat(_Field):
    # the validator's rule in the served schema too (it stays true: test_openapi)
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {**_given("json_schema", "object"), "properties": {
            "type": {"const": "json_schema"}, "json_schema": {"type": "object"}}},
        {"properties": {"type": {"enum": ["text", "json_object"]},
                        "json_schema": {"type": "null"}}}]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    """Required with type "json_schema", refused otherwise."""

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format: json_schema is required with type "json_schema" '
                             "and refused with any other type")
        return self


class StructuredOutputs(_Field):
    """Exactly one of the fields."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        _given(name, json_type) for name, json_type in (
            ("json", ["object", "string"]), ("json_object", "boolean"), ("regex", "string"),
            ("choice", "array"), ("grammar", "string"))]})

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    """A JSON schema (an object, or its JSON text)."""
    json_object: Literal[True] | None = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                      Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    """A Lark grammar (llguidance's dialect)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, "
                             f"choice and grammar (got {len(given)})")
        return self


def requested_output(response_format: ResponseFormat | None,
                     structured_outputs: StructuredOutputs | None) -> StructuredOutput | None:
    """The StructuredOutput a request asks for (None: free text), its grammar checked; an
    APIError (400) naming the field when it is malformed."""
    field = "response_format"
    try:
        if structured_outputs is not None:
            field = "structured_outputs"
            structured = _from_structured_outputs(structured_outputs)
        elif response_format is None or response_format.type == "text":
            return None
        elif response_format.type == "json_object":
            structured = StructuredOutput("json_object")
        else:
            assert response_format.json_schema is not None
            structured = StructuredOutput.json_schema(response_format.json_schema.schema_ or {})
        structured.check()
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", field) from None
    return structured


def _from_structured_outputs(s: StructuredOutputs) -> StructuredOutput:
    if s.json_ is not None:
        text = s.json_ if isinstance(s.json_, str) else json.dumps(s.json_, ensure_ascii=False)
        return StructuredOutput("json_schema", text)
    if s.json_object:
        return StructuredOutput("json_object")
    if s.regex is not None:
        return StructuredOutput("regex", s.regex)
    if s.choice is not None:
        return StructuredOutput.choice(s.choice)
    assert s.grammar is not None
    return StructuredOutput("grammar", s.grammar)
