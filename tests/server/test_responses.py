"""OpenAI's Responses API (/v1/responses): a scripted reply through the renderer (the streamed
events assemble, in the `openai` SDK's own accumulator, into the whole response), the items ->
chat conversion, the store, and the live server through the SDK and raw HTTP (replies,
previous_response_id, retrieve / delete, forced calls, text.format, errors)."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent as SDKEvent
from pydantic import TypeAdapter, ValidationError

from moeserve.server.agent.choice import choose_formats
from moeserve.server.errors import APIError, from_validation_error
from moeserve.server.responses.convert import chat_messages, chat_request
from moeserve.server.responses.events import ResponseRenderer
from moeserve.server.responses.protocol import (
    FunctionCallOutputItem,
    MessageItem,
    ResponseObject,
    ResponsesRequest,
    StreamEvent,
)
from moeserve.server.responses.store import ResponseStore
from moeserve.server.routes.chat import reply_parsers
from moeserve.server.routes.serving import ChoiceResult
from moeserve.tokenizer import ByteTokenizer
from moeserve.types import FinishReason
from tests.server.conftest import LiveServer
from tests.server.helpers import CHAT, post
from tests.server.scripted import named_events, outputs

RESPONSES = "/v1/responses"
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
REPLY = f"<think>\nThe user wants the time.\n</think>\n\nChecking.\n{CALL}\n{CALL}"
TOOL = {"type": "function", "name": "get_time", "description": "the time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
_EVENTS = TypeAdapter(StreamEvent)


def _request(body: dict[str, Any]) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"input": "t?", **body}))


def _renderer(body: dict[str, Any], done: list[dict[str, Any]]) -> ResponseRenderer:
    chat = chat_request(_request(body), [])
    agent = choose_formats("hermes", "qwen3", ByteTokenizer(512, None, None), "Test")
    ctx = types.SimpleNamespace(agent=agent, served_model="m")
    echo = {"instructions": None, "max_output_tokens": None, "model": "m", "background": False,
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
            "store": True, "temperature": 1.0, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [TOOL], "top_p": 1.0, "truncation": "disabled",
            "user": None, "metadata": {}}
    return ResponseRenderer("resp-1", [1, 2, 3], echo,
                            reply_parsers(ctx, chat, "<|assistant|>\n"),  # type: ignore[arg-type]
                            len, done.append)


def _stream(renderer: ResponseRenderer, text: str, step: int,
            finish: FinishReason = FinishReason.STOP) -> list[dict[str, Any]]:
    events = named_events(renderer, text, step, finish)
    for payload in events:
        _EVENTS.validate_python(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _whole(renderer: ResponseRenderer, text: str,
           finish: FinishReason = FinishReason.STOP) -> dict[str, Any]:
    result = ChoiceResult()
    for out in outputs(text, 1000, finish):
        result.add(out, keep=True)
    n = result.num_tokens
    body = renderer.final([result], {"prompt_tokens": 3, "completion_tokens": n,
                                     "total_tokens": 3 + n,
                                     "prompt_tokens_details": {"cached_tokens": 0}})
    ResponseObject.model_validate(body)
    SDKResponse.model_validate(body)
    return body


def _no_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_events_assemble_into_the_whole_response(step: int) -> None:
    done: list[dict[str, Any]] = []
    whole = _whole(_renderer({"tools": [TOOL]}, done), REPLY)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call",
                                                    "function_call"]
    assert whole["output"][0]["content"][0]["text"].strip() == "The user wants the time."
    assert whole["output"][1]["content"][0]["text"].strip() == "Checking."
    assert json.loads(whole["output"][2]["arguments"]) == {"tz": "CET"}
    assert whole["status"] == "completed" and done == [whole]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
        whole["output"][0]["content"][0]["text"])  # (len counts the tokens here)
    streamed_done: list[dict[str, Any]] = []
    events = _stream(_renderer({"tools": [TOOL]}, streamed_done), REPLY, step)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    # the openai SDK's own accumulator assembles the events into the whole response
    state = ResponseStreamState(input_tools=[], text_format=openai.NOT_GIVEN)
    for payload in events:
        state.handle_event(TypeAdapter(SDKEvent).validate_python(payload))
    final = events[-1]["response"]
    assert final == streamed_done[0]
    assert _no_ids(final["output"]) == _no_ids(whole["output"])
    assert [i.model_dump(exclude_none=True)["type"] for i in state._completed_response.output]\
        == [i["type"] for i in whole["output"]]  # type: ignore[union-attr]


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    whole = _whole(_renderer({}, []), "<think>\nhm", FinishReason.LENGTH)
    assert whole["status"] == "incomplete" and whole["output"][0]["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    events = _stream(_renderer({}, []), "<think>\nhm", 2, FinishReason.LENGTH)
    assert events[-1]["type"] == "response.incomplete"


def test_items_become_the_chat_they_are() -> None:
    req = _request({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Time?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_time",
         "arguments": '{"tz": "CET"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "13:00"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Now answer."}]}],
        "tools": [TOOL], "tool_choice": "none",
        "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}}},
        "reasoning": {"effort": "none"}, "max_output_tokens": 9})
    chat = chat_request(req, [])
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
         "tool_calls": [
             {"id": "c1", "type": "function",
              "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
             {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                           "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
        {"role": "tool", "content": "13:00", "tool_call_id": "c2"},
        {"role": "system", "content": "Now answer."}]  # developer: shown as system
    assert chat.tool_choice == "none" and chat.max_tokens == 9
    assert chat.chat_template_kwargs == {"enable_thinking": False, "thinking": False}
    assert chat.response_format is not None and chat.response_format.json_schema is not None


@pytest.mark.parametrize("body,match", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "an image"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "'web_search_call'"),
    ({"tools": [{"type": "web_search"}]}, "built-in tools"),
    ({"tool_choice": "required"}, "offers no function"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True, "store": False}, "background needs store true"),
])
def test_what_a_request_cannot_have(body: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError) as info:
        _request(body)
    assert match in from_validation_error(info.value).message


def test_a_call_whose_arguments_are_not_an_object_is_refused() -> None:
    req = _request({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                               "arguments": "[1]"}]})
    with pytest.raises(APIError, match="not a JSON object"):
        chat_request(req, [])


def test_a_bad_text_format_names_text_format() -> None:
    req = _request({"text": {"format": {"type": "json_schema", "name": "t",
                                        "schema": {"type": "no-such-type"}}}})
    with pytest.raises(APIError) as info:
        chat_request(req, [])
    assert info.value.param == "text.format" and info.value.message.startswith("text.format")
    verbose = _request({"text": {"verbosity": "low"}})  # accepted, no format
    assert verbose.text is not None and "response_format" not in chat_request(
        verbose, []).model_dump(exclude_none=True)
    with pytest.raises(ValidationError, match="verbosity"):
        _request({"text": {"verbosity": "terse"}})


_OUT = [{"id": "m", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "hi", "annotations": []}]}]


def _done(response_id: str) -> dict[str, Any]:
    """A finished response's stored fields."""
    return {"id": response_id, "status": "completed", "output": _OUT}


def test_the_store_keeps_the_most_recent_within_its_bounds() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b", "c"):
        store.add(_done(name), [])
    assert len(store) == 2 and store.get("a") is None
    stored = store.get("b")
    assert stored is not None and chat_messages(stored.items) == [
        {"role": "assistant", "content": "hi"}]
    store.add(_done("d"), [])  # "c" was used least recently
    assert store.get("c") is None and store.get("b") is not None
    big = [MessageItem(role="user", content=os.urandom(6000).hex())]  # ~6 KB zlib'd
    small = ResponseStore(max_responses=10, max_bytes=8_000)
    small.add(_done("x"), big)
    small.add(_done("y"), big)  # the newest is kept whatever its size
    assert small.get("x") is None and small.get("y") is not None
    assert small.delete("y") and not small.delete("y") and len(small) == 0


def test_stored_items_get_ids_and_keep_their_input_apart() -> None:
    store = ResponseStore()
    given = [MessageItem(role="user", content="Hi", id="msg_mine"),
             MessageItem(role="user", content="More"),
             FunctionCallOutputItem(type="function_call_output", call_id="c1", output="4")]
    store.add(_done("r"), given)
    stored = store.get("r")
    assert stored is not None and stored.num_input == 3 and len(stored.items) == 4
    ids = [item.id for item in stored.items]
    assert ids[0] == "msg_mine" and ids[1].startswith("msg_") and ids[2].startswith("fco_")
    assert ids[3] == "m" and len(set(ids)) == 4
    assert chat_messages(stored.items[:3]) == chat_messages(given)


def test_api_processes_share_one_store_file(tmp_path: Path) -> None:
    """Two stores on one file, as --api-servers N's processes open it: what one keeps the
    other finds, uses and deletes; a file of another schema, or none that opens, is refused by
    its path."""
    path = str(tmp_path / "responses.sqlite")
    one, two = ResponseStore(path, max_responses=2), ResponseStore(path, max_responses=2)
    one.add(_done("a"), [MessageItem(role="user", content="Hi")])
    stored = two.get("a")
    assert stored is not None and stored.body["id"] == "a" and stored.num_input == 1
    two.add(_done("b"), [])
    assert one.get("a") is not None  # used last: "b" goes first
    one.add(_done("c"), [])
    assert two.get("b") is None and len(two) == 2
    assert two.delete("a") and one.get("a") is None
    one.close()
    two.close()
    assert ResponseStore(path).get("c") is not None  # it outlives its processes
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(ValueError, match=r"responses.sqlite' was written in format 99"):
        ResponseStore(path)
    with pytest.raises(ValueError, match="cannot be opened"):
        ResponseStore(str(tmp_path))  # a directory


# ---- the live server (tiny-moe, byte tokenizer) --------------------------------------------


def _sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_the_sdk_gets_the_same_reply_whole_and_streamed(long_live: LiveServer) -> None:
    client = _sdk(long_live)
    kwargs: dict[str, Any] = {"model": "tiny-moe", "input": "Hi", "instructions": "S",
                              "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.model == "tiny-moe"
    with client.responses.stream(**kwargs) as stream:  # the SDK's get_final_response()
        ends = [e.response for e in stream  # takes only response.completed
                if e.type in ("response.completed", "response.incomplete")]
    assert len(ends) == 1
    streamed = ends[0]
    assert streamed.output_text == whole.output_text and streamed.status == whole.status
    assert streamed.usage is not None and whole.usage is not None
    assert streamed.usage.output_tokens == whole.usage.output_tokens <= 12
    chat = post(httpx.Client(base_url=long_live.url, timeout=60), CHAT, {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
        "max_tokens": 1})
    assert whole.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_previous_response_id_retrieve_and_delete(long_http: httpx.Client,
                                                 long_live: LiveServer) -> None:
    client = _sdk(long_live)
    first = client.responses.create(model="tiny-moe", input="Hi", instructions="S",
                                     max_output_tokens=6, temperature=0)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = client.responses.create(model="tiny-moe", input="More", max_output_tokens=3,
                                     previous_response_id=first.id)
    # the same as sending the whole conversation (instructions are not carried over)
    items = [{"role": "user", "content": "Hi"},
             *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": "More"}]
    whole = client.responses.create(model="tiny-moe", input=items, max_output_tokens=3,
                                    store=False)
    assert follow.usage is not None and whole.usage is not None
    assert follow.usage.input_tokens == whole.usage.input_tokens
    r = long_http.get(f"{RESPONSES}/{whole.id}")  # store false: not kept
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    assert long_http.delete(f"{RESPONSES}/{first.id}").json() == {
        "id": first.id, "object": "response", "deleted": True}
    r = long_http.post(RESPONSES, json={"input": "x", "previous_response_id": first.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_input_items_list_what_a_response_took_in(long_http: httpx.Client,
                                                   long_live: LiveServer) -> None:
    """The history it continued and its own input, newest first by default, in pages by id;
    the openai SDK's pager reads them; bad queries are 400s naming the parameter."""
    client = _sdk(long_live)
    first = client.responses.create(model="tiny-moe", input="Hi", max_output_tokens=3)
    follow = client.responses.create(model="tiny-moe", max_output_tokens=3,
                                      previous_response_id=first.id, input=[
                                          {"role": "user", "content": "More", "id": "msg_x"},
                                          {"role": "user", "content": "Again"}])
    listed = list(client.responses.input_items.list(follow.id, order="asc", limit=2))
    assert [i.type for i in listed] == ["message", *(o.type for o in first.output),
                                        "message", "message"]
    texts = [i.content[0].text if not isinstance(i.content, str) else i.content  # type: ignore
             for i in listed if getattr(i, "role", "") == "user"]
    assert texts == ["Hi", "More", "Again"] and listed[-2].id == "msg_x"
    assert [i.id for i in listed[1:-2]] == [o.id for o in first.output]
    url = f"{RESPONSES}/{follow.id}/input_items"
    page = long_http.get(url, params={"limit": 1}).json()
    assert page["object"] == "list" and page["has_more"] and len(page["data"]) == 1
    assert page["first_id"] == page["last_id"] == listed[-1].id  # desc: the newest first
    rest = long_http.get(url, params={"after": page["last_id"], "limit": 100}).json()
    assert [i["id"] for i in rest["data"]] == [i.id for i in reversed(listed[:-1])]
    assert not rest["has_more"]
    for params, status, param in (({"limit": 0}, 400, "limit"), ({"order": "up"}, 400, "order"),
                                  ({"before": "x"}, 400, "before"), ({"after": "no"}, 404,
                                                                      "after")):
        r = long_http.get(url, params=params)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert long_http.get(f"{RESPONSES}/resp-none/input_items").status_code == 404


def test_a_forced_call_and_a_json_format(long_live: LiveServer) -> None:
    client = _sdk(long_live)
    tool = {"type": "function", "name": "t", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
        "additionalProperties": False}}
    called = client.responses.create(model="tiny-moe", input="x", max_output_tokens=60,
                                     tools=[tool], tool_choice={"type": "function", "name": "t"},
                                     reasoning={"effort": "none"})  # type: ignore[list-item]
    calls = [i for i in called.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "t", called
    assert isinstance(json.loads(calls[0].arguments)["n"], int)
    formatted = client.responses.create(
        model="tiny-moe", input="x", max_output_tokens=60, reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "c", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}})
    assert formatted.status == "completed"
    assert isinstance(json.loads(formatted.output_text)["ok"], bool)


def test_errors_name_the_field(http: httpx.Client) -> None:
    r = http.post(RESPONSES, json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]})
    assert r.status_code == 400 and "an image" in r.json()["error"]["message"]
    r = http.post(RESPONSES, json={"input": "x", "max_output_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
    assert http.post(RESPONSES, json={"input": "x", "model": "nope"}).status_code == 404
