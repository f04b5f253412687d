"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): a scripted reply through
the renderer (streamed events join up to the whole message, as Anthropic's own SDK assembles
them), the request -> chat conversion, and the live server through the `anthropic` SDK and raw
HTTP (replies, prefill, stop sequences, forced tool calls, token counts, errors in Anthropic's
shape, the x-api-key header)."""

from __future__ import annotations

import json
import types
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SDKMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from moeserve.server.agent.choice import choose_formats
from moeserve.server.anthropic.convert import chat_request
from moeserve.server.anthropic.events import Blocks, MessageRenderer, stop_reason
from moeserve.server.anthropic.protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    StreamEvent,
)
from moeserve.server.errors import APIError
from moeserve.server.routes.chat import reply_parsers
from moeserve.server.routes.serving import ChoiceResult
from moeserve.tokenizer import ByteTokenizer
from moeserve.types import FinishReason
from tests.server.conftest import API_KEY, LiveServer
from tests.server.helpers import CHAT, post
from tests.server.scripted import named_events, outputs

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
REPLY = f"<think>\nThe user wants the time.\n</think>\n\nChecking.\n{CALL}\n{CALL}"
TOOL = {"name": "get_time", "description": "the time",
        "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
_EVENTS = TypeAdapter(StreamEvent)


def _renderer(body: dict[str, Any], stop: tuple[str, ...] = ()) -> MessageRenderer:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4096,
                                          "messages": [{"role": "user", "content": "t?"}],
                                          **body})
    chat, _ = chat_request(req)
    agent = choose_formats("hermes", "qwen3", ByteTokenizer(512, None, None), "Test")
    ctx = types.SimpleNamespace(agent=agent, served_model="m")
    return MessageRenderer("m", "msg-1", [1, 2, 3],
                           reply_parsers(ctx, chat, "<|assistant|>\n"),  # type: ignore[arg-type]
                           stop)


def _stream(renderer: MessageRenderer, text: str, step: int,
            finish: FinishReason = FinishReason.STOP) -> list[dict[str, Any]]:
    events = named_events(renderer, text, step, finish)
    for payload in events:
        _EVENTS.validate_python(payload)
    return events


def _whole(renderer: MessageRenderer, text: str,
           finish: FinishReason = FinishReason.STOP) -> dict[str, Any]:
    result = ChoiceResult()
    for out in outputs(text, 1000, finish):
        result.add(out, keep=True)
    usage = {"prompt_tokens": 3, "completion_tokens": result.num_tokens,
             "prompt_tokens_details": {"cached_tokens": 0}}
    message = renderer.final([result], usage)
    MessageResponse.model_validate(message)
    return message


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_events_join_up_to_the_whole_message(step: int) -> None:
    whole = _whole(_renderer({"tools": [TOOL]}), REPLY)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["content"][0]["thinking"].strip() == "The user wants the time."
    assert whole["content"][1]["text"].strip() == "Checking."
    assert whole["content"][2]["input"] == {"tz": "CET"} and whole["stop_reason"] == "tool_use"
    events = _stream(_renderer({"tools": [TOOL]}), REPLY, step)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    # Anthropic's own SDK assembles the events into the message `final` answers
    snapshot, json_bufs = None, {}  # type: ignore[var-annotated]
    for payload in events:
        snapshot = accumulate_event(
            event=TypeAdapter(RawMessageStreamEvent).validate_python(payload),
            current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    streamed = snapshot.model_dump(exclude_none=True)
    for block in streamed["content"]:
        block.pop("citations", None)
    ids = [b["id"] for b in streamed["content"] if b["type"] == "tool_use"]
    assert len(set(ids)) == 2  # fresh ids per reply: compare the rest
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed["content"]] == [
        {k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert streamed["stop_reason"] == "tool_use"
    assert streamed["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_blocks_open_at_their_first_text_that_is_not_whitespace() -> None:
    blocks = Blocks()
    from moeserve.server.agent.reply import ReplyPart

    events = blocks.feed(ReplyPart(reasoning="\n")) + blocks.feed(ReplyPart(content="\n\n"))
    assert events == [] and blocks.content == []
    events = blocks.feed(ReplyPart(content=" Hi"))
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta"]
    # the held whitespace of its own kind leads it; the reasoning's is dropped
    assert blocks.content == [{"type": "text", "text": "\n\n Hi"}]
    assert blocks.close() == [{"type": "content_block_stop", "index": 0}]


@pytest.mark.parametrize("finish,stop,expected", [
    ("length", None, ("max_tokens", None)), ("stop", "END", ("stop_sequence", "END")),
    ("stop", "other", ("end_turn", None)), ("stop", 7, ("end_turn", None)),
    ("stop", None, ("end_turn", None))])
def test_stop_reasons(finish: str, stop: Any, expected: tuple[Any, Any]) -> None:
    result = ChoiceResult(finish_reason=finish, stop_reason=stop)
    assert stop_reason(result, 0, ("END",)) == expected
    assert stop_reason(result, 1, ("END",))[0] == (
        "max_tokens" if finish == "length" else "tool_use")


def test_a_conversation_becomes_the_chat_it_is() -> None:
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 2048, "stop_sequences": ["END"], "temperature": 0.5,
        "top_k": 5, "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use tools."}],
        "tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"tz": "CET"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
                {"type": "text", "text": "And?"}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                              {"type": "text", "text": "Noon"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2",
                                          "content": [{"type": "text", "text": "down"}],
                                          "is_error": True}]},
            {"role": "assistant", "content": "It is"}]})
    chat, prefill = chat_request(req)
    assert prefill == "It is"
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Noon"},
        {"role": "tool", "content": "Error: down", "tool_call_id": "t2"}]
    assert chat.tools is not None and chat.tools[0].function.parameters == TOOL["input_schema"]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": True, "thinking": True}
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.user) == (
        2048, ["END"], 0.5, 5, "u1")
    forced = chat_request(req.model_copy(update={"tool_choice": MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
         "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_time"}}).tool_choice}))[0]
    assert forced.forces_call and forced.tool_choice.function.name == "get_time"  # type: ignore


@pytest.mark.parametrize("body,match", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "image block"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                 "input": {}}]}]}, "only an assistant"),
    ({"tools": [{"name": "s", "type": "web_search_20250305"}]}, "server tool"),
    ({"tool_choice": {"type": "any"}}, "offers no tool"),
    ({"tools": [TOOL, TOOL]}, "twice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "less than max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"service_tier": "auto"}, "unsupported field 'service_tier'"),
    ({"output_config": {"effort": "high"}}, "unsupported field 'output_config.effort'"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "tools": [TOOL]},
     "send tool_choice none, or no output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}, "tools": [TOOL],
      "tool_choice": {"type": "any"}}, "send one of the two"),
    ({"output_config": {"format": {"type": "text"}}}, "output_config.format.type"),
])
def test_what_a_request_cannot_have(body: dict[str, Any], match: str) -> None:
    from pydantic import ValidationError

    from moeserve.server.errors import from_validation_error

    base = {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError) as info:
        MessagesRequest.model_validate_json(json.dumps({**base, **body}))
    assert match in from_validation_error(info.value).message


def test_an_output_format_and_strict_tools_become_the_chat_routes() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    base = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    chat, _ = chat_request(MessagesRequest.model_validate({**base, "output_config": {
        "format": {"type": "json_schema", "schema": schema}}}))
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == schema  # type: ignore[union-attr]
    chat, _ = chat_request(MessagesRequest.model_validate({
        **base, "tools": [{**TOOL, "strict": True}], "tool_choice": {"type": "none"},
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}))
    assert chat.tools is not None and chat.tools[0].function.strict is True
    assert chat.tool_choice == "none" and chat.response_format is not None


def test_a_prefill_with_other_blocks_than_text_is_refused() -> None:
    req = CountTokensRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                           "input": {}}]}]})
    with pytest.raises(APIError, match="only text blocks"):
        chat_request(req)


# ---- the live server (tiny-moe, byte tokenizer, max_model_len 128) -------------------------


def _sdk(live: LiveServer, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, **kw)


def test_the_anthropic_sdk_gets_the_same_reply_whole_and_streamed(live: LiveServer) -> None:
    client = _sdk(live)
    kwargs: dict[str, Any] = {"model": "tiny-moe", "max_tokens": 12, "system": "S",
                              "messages": [{"role": "user", "content": "Hi"}],
                              "extra_body": {"temperature": 0}}  # (the SDK has no argument)
    whole = client.messages.create(**kwargs)
    assert isinstance(whole, SDKMessage) and whole.model == "tiny-moe"
    assert whole.id.startswith("msg-") and whole.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens <= 12
    counted = client.messages.count_tokens(model="tiny-moe", system="S",
                                           messages=[{"role": "user", "content": "Hi"}])
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) \
        == counted.input_tokens


def test_the_prompt_is_the_chat_routes_and_a_prefill_continues_it(http: httpx.Client) -> None:
    chat = post(http, CHAT, {"messages": [{"role": "system", "content": "S"},
                                          {"role": "user", "content": "Hi"}], "max_tokens": 1})
    count = post(http, COUNT, {"model": "tiny-moe", "system": "S",
                               "messages": [{"role": "user", "content": "Hi"}]})
    assert count["input_tokens"] == chat["usage"]["prompt_tokens"]
    prefilled = post(http, COUNT, {"model": "tiny-moe", "system": "S", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure:"}]})
    assert prefilled["input_tokens"] == count["input_tokens"] + len("Sure:")  # byte tokens
    reply = post(http, MESSAGES, {"model": "tiny-moe", "max_tokens": 3, "system": "S",
                                  "messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Sure:"}]})
    usage = reply["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prefilled["input_tokens"]


def test_a_stop_sequence_ends_the_reply(http: httpx.Client) -> None:
    body = {"model": "tiny-moe", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    free = post(http, MESSAGES, body)
    text = "".join(b.get("text", "") + b.get("thinking", "") for b in free["content"])
    # two characters of one block (a block's text is the reply's own, unbroken by markers),
    # not its first: something the reply reaches after it began
    stops = [piece for b in free["content"] for t in (b.get("text") or b.get("thinking", ""),)
             for i in range(1, len(t) - 1) if (piece := t[i:i + 2]).strip() == piece]
    assert stops, free["content"]  # something to stop at
    stop = stops[0]
    stopped = post(http, MESSAGES, {**body, "stop_sequences": [stop]})
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == stop
    out = "".join(b.get("text", "") + b.get("thinking", "") for b in stopped["content"])
    assert stop not in out and len(out) < len(text)


def test_a_forced_tool_call_comes_back_as_a_tool_use_block(long_live: LiveServer) -> None:
    tool = {"name": "t", "input_schema": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}
    reply = _sdk(long_live).messages.create(
        model="tiny-moe", max_tokens=60, messages=[{"role": "user", "content": "x"}],
        tools=[tool], tool_choice={"type": "tool", "name": "t"},  # type: ignore[list-item]
        thinking={"type": "disabled"})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1, reply
    assert uses[0].name == "t" and set(uses[0].input) == {"n"}  # type: ignore[arg-type]
    assert isinstance(uses[0].input["n"], int)  # type: ignore[index]


def test_an_output_format_holds_the_reply_to_its_schema(long_live: LiveServer) -> None:
    schema = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
              "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}
    reply = _sdk(long_live).messages.create(
        model="tiny-moe", max_tokens=80, messages=[{"role": "user", "content": "x"}],
        thinking={"type": "disabled"},
        output_config={"format": {"type": "json_schema", "schema": schema}})
    [block] = reply.content
    assert block.type == "text" and reply.stop_reason == "end_turn", reply
    value = json.loads(block.text)
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int)
    assert isinstance(value["ok"], bool)


def test_errors_come_in_anthropics_shape(http: httpx.Client, live: LiveServer) -> None:
    r = http.post(MESSAGES, json={"model": "tiny-moe", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image block" in body["error"]["message"] and body["request_id"]
    r = http.post(MESSAGES, json={"model": "nope", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.post(COUNT, json={"model": "tiny-moe", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens is too large"):
        _sdk(live).messages.create(model="tiny-moe", max_tokens=1_000,
                                   messages=[{"role": "user", "content": "x"}])


def test_the_key_may_come_as_x_api_key(live: LiveServer) -> None:
    body = {"model": "tiny-moe", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(base_url=live.keyed_url, timeout=60) as keyed:
        r = keyed.post(MESSAGES, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert keyed.post(MESSAGES, json=body, headers={"x-api-key": "wrong"}).status_code == 401
        assert keyed.post(MESSAGES, json=body, headers={"x-api-key": API_KEY}).status_code == 200
        assert keyed.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    sdk = anthropic.Anthropic(base_url=live.keyed_url, api_key=API_KEY, max_retries=0)
    assert sdk.messages.create(**body).usage.output_tokens == 1  # type: ignore[arg-type]


def test_a_thinking_budget_becomes_the_engines_reasoning_budget() -> None:
    """budget_tokens (and chat's thinking_token_budget) -> (end marker's id, budget, start
    marker's id, or -1 when the template opened the reasoning); or why not, without a
    reasoning format or one-token markers (Messages then only checks it, chat answers 400)."""
    from moeserve.server.agent.reasoning import ReasoningFormat
    from moeserve.server.routes.chat import reasoning_budget

    ids = {"<think>": [6], "</think>": [7]}

    def ctx(reasoning: ReasoningFormat | None, one_token: bool = True) -> Any:
        encode = (lambda text, add_special_tokens: ids.get(text, list(text.encode()))) \
            if one_token else (lambda text, add_special_tokens: list(text.encode()))
        return types.SimpleNamespace(agent=types.SimpleNamespace(reasoning=reasoning),
                                     client=types.SimpleNamespace(
                                         tokenizer=types.SimpleNamespace(encode=encode)))

    qwen = ReasoningFormat("qwen3")
    assert reasoning_budget(ctx(qwen), 2048, "<|assistant|>\n<think>\n") == (7, 2048, -1)
    assert reasoning_budget(ctx(qwen), 2048, "<|assistant|>\n") == (7, 2048, 6)
    assert "reads no reasoning" in reasoning_budget(ctx(None), 2048, "")  # type: ignore
    assert "not one token" in reasoning_budget(  # type: ignore[operator]
        ctx(qwen, one_token=False), 2048, "<think>")
