"""Strict tools under tool_choice "auto" (agent/strict_calls.py): the grammar leaves text free and
holds each call to its tool's schema, read token by token by llguidance over the byte
vocabulary; chat_output gives it under "auto" only, where the format takes it (a forced call
has its own grammar; a format asked beside tools under "auto" is refused before)."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
from llguidance import LLMatcher

from moeserve.server.agent.choice import choose_formats
from moeserve.server.agent.protocol import Tool
from moeserve.server.agent.strict_calls import strict_calls_output
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.routes.chat import chat_output
from moeserve.structured.spec import StructuredOutput
from moeserve.structured.vocabulary import grammar_tokenizer
from moeserve.tokenizer import ByteTokenizer
from tests.server.agent.test_forced_calls import _ThinkTokenizer

BYTES = ByteTokenizer(512, None, None)
TZ = {"type": "object", "required": ["tz"], "additionalProperties": False,
      "properties": {"tz": {"type": "string"}}}


def _tools(strict_time: bool = True) -> list[Tool]:
    return [Tool.model_validate({"type": "function", "function": {
        "name": "time", "parameters": TZ, "strict": strict_time}}),
        Tool.model_validate({"type": "function", "function": {
            "name": "note", "parameters": {"type": "object", "required": ["text"],
                                           "properties": {"text": {"type": "string"}}}}})]


def _call(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


def _reads(structured: StructuredOutput, text: str) -> bool:
    """Whether the grammar takes `text` whole, token by token, and may end there."""
    matcher = LLMatcher(grammar_tokenizer(BYTES, 512, []), structured.grammar(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in BYTES.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


def _hermes(parallel: bool = True, tools: list[Tool] | None = None) -> StructuredOutput:
    out = strict_calls_output("hermes", "<tool_call>", "</tool_call>", tools or _tools(),
                              parallel)
    assert out is not None and out.kind == "grammar"
    out.check()
    return out


@pytest.mark.parametrize("text", [
    "",
    "Just text, with < and <tool and <tool_ca and tool_call> but no call.",
    "Checking. " + _call("time", {"tz": "CET"}),
    _call("time", {"tz": "CET"}) + "\nand " + _call("note", {"text": "x"}) + " done",
    _call("note", {"anything": [1, {"goes": True}]}),  # note is not strict: any object
])
def test_text_is_free_and_a_strict_call_valid_under_its_schema_is_taken(text: str) -> None:
    assert _reads(_hermes(), text)


@pytest.mark.parametrize("text", [
    "Checking. " + _call("clock", {"tz": "CET"}),  # not an offered function
    _call("time", {"tz": 3}),  # a number where the schema asks a string
    _call("time", {}),  # its required property missing
    _call("time", {"tz": "CET", "extra": 1}),  # a property the schema does not allow
    "Checking. <tool_call> and then prose",  # an opened call must be a call
    _call("note", [1, 2]),  # arguments must be an object even when not strict
])
def test_a_call_off_its_schema_is_refused(text: str) -> None:
    assert not _reads(_hermes(), text)


def test_without_parallel_calls_one_call_at_most() -> None:
    one, two = _call("time", {"tz": "CET"}), _call("note", {"text": "x"})
    assert _reads(_hermes(parallel=False), f"a {one} b")
    assert not _reads(_hermes(parallel=False), f"a {one} b {two}")


def test_only_strict_tools_and_a_format_that_takes_them_get_a_grammar() -> None:
    assert strict_calls_output("hermes", "<tool_call>", "</tool_call>",
                               _tools(strict_time=False), True) is None
    for name, opener, closer in (("glm45", "<tool_call>", "</tool_call>"),
                                 ("mistral", "[TOOL_CALLS]", None)):
        assert strict_calls_output(name, opener, closer, _tools(), True) is None


def _ctx(tokenizer: ByteTokenizer, tool_parser: str = "hermes",
         reasoning: str = "none") -> Any:
    agent = choose_formats(tool_parser, reasoning, tokenizer, "Test")
    return types.SimpleNamespace(agent=agent, client=types.SimpleNamespace(tokenizer=tokenizer))


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "t?"}],
        "tools": [t.model_dump(exclude_none=True) for t in _tools()], **fields})


def test_chat_output_gives_it_under_auto_and_only_there() -> None:
    ctx = _ctx(BYTES)
    prompt = "<|assistant|>\n"
    auto = chat_output(ctx, _request(), prompt)
    assert auto is not None and auto.kind == "grammar" and "<tool_call>" in auto.spec
    assert chat_output(ctx, _request(tool_choice="none"), prompt) is None
    formatted = chat_output(ctx, _request(tool_choice="none",
                                          response_format={"type": "json_object"}), prompt)
    assert formatted is not None and formatted.kind == "json_object"
    forced = chat_output(ctx, _request(tool_choice="required"), prompt)
    assert forced is not None and forced.kind == "json_schema"
    loose = _request(tools=[t.model_dump(exclude_none=True) for t in _tools(False)])
    assert chat_output(ctx, loose, prompt) is None
    glm = _ctx(BYTES, "glm45")
    assert chat_output(glm, _request(), prompt) is None
    assert ctx.agent.describe()["strict_tools_under_auto"] == "enforced"
    assert glm.agent.describe()["strict_tools_under_auto"].startswith("not enforced: glm45")


@pytest.mark.parametrize("tokenizer, start_after", [(_ThinkTokenizer(512, None, None), 300),
                                                    (BYTES, None)])
def test_inside_the_reasoning_it_starts_after_a_one_token_end_else_is_not_kept(
        tokenizer: ByteTokenizer, start_after: int | None) -> None:
    """Unlike a format the request asks (a 400 there), strict tools under auto are kept only
    where they can be: a reply that starts inside the reasoning, whose end marker is several
    tokens, is served without the grammar."""
    ctx = _ctx(tokenizer, reasoning="deepseek_r1")
    structured = chat_output(ctx, _request(), "<|assistant|>\n<think>\n")
    if start_after is None:
        assert structured is None
    else:
        assert structured is not None and structured.start_after == start_after


def test_the_live_server_serves_strict_tools_under_auto_through_the_grammar(
        long_live: Any) -> None:
    """tiny-moe's server (hermes calls, byte vocabulary): /v1/engine says strict tools are
    enforced, and a reply under auto with a strict tool is generated through the grammar (the
    engine compiled it) to its end; whatever calls it writes are valid."""
    import httpx

    with httpx.Client(base_url=long_live.url, timeout=60) as http:
        engine = http.get("/v1/engine").json()
        assert engine["server"]["strict_tools_under_auto"] == "enforced", engine["server"]
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "time?"}], "max_tokens": 24,
            "tools": [t.model_dump(exclude_none=True) for t in _tools()], "seed": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        for call in choice["message"].get("tool_calls") or []:
            assert call["function"]["name"] in ("time", "note")
            json.loads(call["function"]["arguments"])
