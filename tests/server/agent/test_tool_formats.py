"""Each family's tool-call text: the examples as the models write them parse to their calls,
what `render` writes parses back, malformed blocks come back as content, GLM's values are typed
by the schema."""

from __future__ import annotations

from typing import Any

import pytest

from moeserve.server.agent.tool_formats import TOOL_FORMATS
from moeserve.server.agent.tool_splitter import ParsedCall, ToolCallSplitter

SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "days": {"type": "integer"}}},
    "get_time": {"type": "object", "properties": {"tz": {"type": "string"}}},
}
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"tz": "CET"})

# Replies as each family's models write them (vLLM's and SGLang's parsers and the models'
# chat templates agree on these layouts).
WRITTEN = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
               '</tool_call>'),
    "glm45": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>"
              "get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"),
    "glm47": ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>get_time"
              "<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n'
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
                    '{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v31": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>'
                     'get_time<｜tool▁sep｜>{"tz": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v32": ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                     '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                     '</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">\n'
                     '<｜DSML｜parameter name="tz" string="true">CET</｜DSML｜parameter>\n'
                     '</｜DSML｜invoke>\n</｜DSML｜function_calls>'),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
                "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
                '{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "get_time", "arguments": {"tz": "CET"}}]'),
}


def split(name: str, text: str, parallel: bool = True) -> tuple[str, list[ParsedCall]]:
    splitter = ToolCallSplitter(TOOL_FORMATS[name], SCHEMAS, parallel)
    content, calls = splitter.feed(text)
    rest, more = splitter.finish()
    return content + rest, calls + more


def test_every_format_has_a_written_example() -> None:
    assert set(WRITTEN) == set(TOOL_FORMATS)


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_written_calls_parse(name: str) -> None:
    content, calls = split(name, "Checking both.\n\n" + WRITTEN[name])
    assert content == "Checking both."
    assert [(c.name, c.arguments) for c in calls] == [WEATHER, TIME]
    if name == "kimi_k2":  # the model's own ids, which its template echoes back
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    elif name == "mistral":  # Mistral's templates take only 9 letters and digits
        assert all(c.id and len(c.id) == 9 and c.id.isalnum() for c in calls)
    else:
        assert all(c.id is None for c in calls)


@pytest.mark.parametrize("name", sorted(TOOL_FORMATS))
def test_rendered_calls_parse_back(name: str) -> None:
    fmt = TOOL_FORMATS[name]
    calls = [WEATHER, ("get_time", {"tz": "CET"}), ("get_weather", {"city": "日本", "days": 0})]
    content, parsed = split(name, fmt.render(calls))
    assert content == "" and [(c.name, c.arguments) for c in parsed] == calls


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_only_the_first_call_without_parallel_calls(name: str) -> None:
    content, calls = split(name, WRITTEN[name], parallel=False)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [WEATHER]


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>'),
    ("glm47", "<tool_call>get weather<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"),
    ("glm47", "<tool_call>get_time<arg_key>tz</arg_key>junk<arg_value>x</arg_value></tool_call>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{tz}"
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|>stray<|tool_calls_section_end|>"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "CET"}'),
])
def test_a_block_that_does_not_parse_is_content_as_written(name: str, text: str) -> None:
    assert split(name, "Hi. " + text) == ("Hi. " + text, [])


def test_an_unclosed_block_parses_at_the_end_or_is_content() -> None:
    # Mistral's block runs to the end of the reply; a hermes block cut off still parses when
    # its JSON is whole, and is content when it is not
    whole = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
    assert split("hermes", whole)[1] == [ParsedCall("get_time", {"tz": "CET"})]
    cut = '<tool_call>\n{"name": "get_time", "argu'
    assert split("hermes", cut) == (cut, [])


def test_glm_values_are_typed_by_the_schema() -> None:
    schemas = {"f": {"properties": {"s": {"type": "string"}, "n": {"type": "integer"},
                                    "e": {"enum": ["a", "b"]},
                                    "o": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}
    text = ("<tool_call>f<arg_key>s</arg_key><arg_value>007</arg_value>"
            "<arg_key>n</arg_key><arg_value>7</arg_value><arg_key>e</arg_key><arg_value>a"
            "</arg_value><arg_key>o</arg_key><arg_value>null</arg_value>"
            "<arg_key>extra</arg_key><arg_value>[1, 2]</arg_value>"
            "<arg_key>word</arg_key><arg_value>plain text</arg_value></tool_call>")
    splitter = ToolCallSplitter(TOOL_FORMATS["glm47"], schemas)
    _, calls = splitter.feed(text)
    assert calls[0].arguments == {"s": "007", "n": 7, "e": "a", "o": None, "extra": [1, 2],
                                  "word": "plain text"}


def test_dsml_values_follow_their_string_attribute() -> None:
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n'
            '<｜DSML｜parameter name="tz" string="true">[1]</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="n" string="false">[1]</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    assert split("deepseek_v32", text)[1][0].arguments == {"tz": "[1]", "n": [1]}
