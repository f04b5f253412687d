"""The chat route's replies with tools and reasoning: a scripted engine output through the
renderer (streamed deltas join up to the whole message; calls indexed across the stream;
"tool_calls" as the finish reason), and the live server (tools and a history of calls accepted
and rendered, the formats shown at /v1/engine, refusals)."""

from __future__ import annotations

import json
import types
from typing import Any

import httpx
import pytest

from moeserve.server.agent.choice import choose_formats
from moeserve.server.agent.tool_formats import TOOL_FORMATS
from moeserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
)
from moeserve.server.routes.chat import ChatRenderer, reply_parsers
from moeserve.server.routes.serving import ChoiceResult
from moeserve.tokenizer import ByteTokenizer, default_chat_template
from moeserve.types import FinishReason, RequestOutput
from tests.server.conftest import LiveServer
from tests.server.helpers import CHAT, post, stream

TOOL = {"type": "function", "function": {"name": "get_time", "description": "the time",
                                         "parameters": {"type": "object", "properties": {
                                             "tz": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
REPLY = f"<think>\nThe user wants the time.\n</think>\n\nChecking.\n{CALL}\n{CALL}"


def _renderer(body: dict[str, Any], prompt_text: str = "<|assistant|>\n") -> ChatRenderer:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "t?"}],
                                                **body})
    agent = choose_formats("hermes", "qwen3", ByteTokenizer(512, None, None), "Test")
    ctx = types.SimpleNamespace(agent=agent, served_model="m")
    return ChatRenderer(ctx, "chatcmpl-1", False,  # type: ignore[arg-type]
                        reply_parsers(ctx, req, prompt_text))  # type: ignore[arg-type]


def _streamed(renderer: ChatRenderer, text: str, step: int,
              finish: FinishReason = FinishReason.STOP) -> list[dict[str, Any]]:
    result, choices = ChoiceResult(), []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out = RequestOutput("r", [1], [ord(c) % 256 for c in piece], finished=last,
                            finish_reason=finish if last else None, text=piece)
        result.add(out, keep=False)
        choices.append(renderer.chunk(0, out, result))
    for choice in choices:
        ChatCompletionStreamResponse.model_validate({**renderer.envelope(), "choices": [choice]})
    return choices


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_deltas_join_up_to_the_whole_message(step: int) -> None:
    whole, finish = _renderer({"tools": [TOOL]}).message(REPLY, "stop")
    assert finish == "tool_calls"
    assert whole["content"] == "Checking." and whole["reasoning_content"] == (
        "The user wants the time.\n")
    assert [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        {"tz": "CET"}] * 2
    choices = _streamed(_renderer({"tools": [TOOL]}), REPLY, step)
    deltas = [c["delta"] for c in choices]
    assert "".join(d.get("content", "") for d in deltas) == whole["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
    assert [c["finish_reason"] for c in choices][-1] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_finish_reasons_and_plain_replies() -> None:
    renderer = _renderer({"tools": [TOOL]})
    assert renderer.message(CALL, "length")[1] == "length"  # cut off: not "tool_calls"
    message, finish = renderer.message("No call needed.", "stop")
    assert finish == "stop" and message == {"role": "assistant", "content": "No call needed.",
                                            "reasoning_content": None}
    # tool_choice "none": calls stay text; no tools: the same
    for body in ({"tools": [TOOL], "tool_choice": "none"}, {}):
        message, finish = _renderer(body).message(CALL, "stop")
        assert finish == "stop" and message["content"] == CALL and "tool_calls" not in message
    # a prompt that opened the reasoning
    message, _ = _renderer({}, "<|assistant|>\n<think>").message("hm</think>Yes.", "stop")
    assert (message["reasoning_content"], message["content"]) == ("hm", "Yes.")
    ChatCompletionResponse.model_validate({
        **_renderer({}).envelope(), "object": "chat.completion", "usage": {
            "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "choices": [{"index": 0, "message": message, "token_ids": [1],
                     "finish_reason": "tool_calls"}]})


# ---- the live server (tiny-moe: Qwen3's architecture, the byte tokenizer, no template) ------


def test_engine_shows_the_formats_and_why(http: httpx.Client) -> None:
    server = http.get("/v1/engine").json()["server"]
    assert server["tool_call_parser"] == "hermes" and server["reasoning_parser"] == "think"
    assert "no chat template" in server["tool_call_parser_reason"]
    assert server["keep_special_tokens"] is False


def _prompt_tokens(live: LiveServer, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None) -> int:
    text = default_chat_template(messages, True, tools)
    return len(live.client.tokenizer.encode(text, add_special_tokens=False))


def test_tools_are_rendered_and_replies_parsed(http: httpx.Client, live: LiveServer) -> None:
    # (the live server's max_model_len is 128 byte tokens: short tools and messages)
    tools = [{"type": "function", "function": {"name": "t"}}]
    body = {"messages": [{"role": "developer", "content": "B"}, {"role": "user", "content": "T"}],
            "tools": tools, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = post(http, CHAT, body)
    ChatCompletionResponse.model_validate(out)
    assert out["usage"]["prompt_tokens"] == _prompt_tokens(
        live, [{"role": "system", "content": "B"}, {"role": "user", "content": "T"}], tools)
    message = out["choices"][0]["message"]
    assert "reasoning_content" in message  # the reasoning parser is on (auto)
    events = stream(http, CHAT, body)
    for event in events:
        ChatCompletionStreamResponse.model_validate(event)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (
        message["reasoning_content"] or "")


def test_a_history_of_calls_is_rendered_in_the_format(http: httpx.Client,
                                                      live: LiveServer) -> None:
    history = [
        {"role": "user", "content": "T"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12"},
    ]
    out = post(http, CHAT, {"messages": history, "max_tokens": 4})
    assert out["usage"]["prompt_tokens"] == _prompt_tokens(live, [
        {"role": "user", "content": "T"},
        {"role": "assistant", "content": TOOL_FORMATS["hermes"].render([("t", {})])},
        {"role": "tool", "content": "12"}], None)


def test_chat_template_kwargs_reach_the_template(http: httpx.Client) -> None:
    # the default template has no variables of its own: accepted and without effect
    plain = post(http, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    kw = post(http, CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                           "chat_template_kwargs": {"enable_thinking": False}})
    assert kw["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def _ctx(tokenizer: Any, tool_parser: str = "auto") -> Any:
    agent = choose_formats(tool_parser, "auto", tokenizer, "Qwen3MoeForCausalLM")
    return types.SimpleNamespace(agent=agent, client=types.SimpleNamespace(tokenizer=tokenizer))


def test_a_template_that_joins_arguments_as_text_gets_them_as_text(tmp_path: Any) -> None:
    import asyncio

    from moeserve.server.routes.chat import chat_prompt
    from moeserve.tokenizer import HFTokenizer
    from tests.test_tokenizer import _write_bpe

    # DeepSeek-V3's template writes "..." + arguments + "...": a mapping fails there
    _write_bpe(tmp_path, "{% for m in messages %}{% for tc in m.tool_calls or [] %}"
                         "{{ '<call>' + tc.function.name + ':' + tc.function.arguments }}"
                         "{% endfor %}{% endfor %}")
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "t?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}]})
    text, ids = asyncio.run(chat_prompt(_ctx(HFTokenizer(str(tmp_path))), req))
    assert text == '<call>f:{"a": 1}' and ids


def test_tools_need_a_format_unless_tool_choice_is_none() -> None:
    from moeserve.server.errors import APIError
    from moeserve.server.routes.chat import check_agent_fields

    ctx = _ctx(ByteTokenizer(512, None, None), tool_parser="none")
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "t"}],
                                                "tools": [TOOL]})
    with pytest.raises(APIError, match=r"parses no tool calls \(--tool-call-parser none\)"):
        check_agent_fields(ctx, req)
    check_agent_fields(ctx, req.model_copy(update={"tool_choice": "none"}))


def test_the_openai_sdk_assembles_the_streamed_calls() -> None:
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    renderer = _renderer({"tools": [TOOL]})
    whole, _ = _renderer({"tools": [TOOL]}).message(REPLY, "stop")
    state = ChatCompletionStreamState(input_tools=[TOOL])
    head = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    choices = _streamed(renderer, REPLY, 5)
    for choice in [head, *choices]:
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**renderer.envelope(), "choices": [choice]}))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking."
    sent_ids = [c["id"] for choice in choices for c in choice["delta"].get("tool_calls", [])]
    assert [c.id for c in final.message.tool_calls] == sent_ids and len(set(sent_ids)) == 2
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
