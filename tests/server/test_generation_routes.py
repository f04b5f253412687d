"""Completions and chat against the real engine client: shapes, usage, streaming, n, stops."""

from __future__ import annotations

from typing import Any

import httpx

from moeserve.server.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
)
from tests.server.conftest import MAX_MODEL_LEN, LiveServer
from tests.server.helpers import CHAT, COMPLETIONS, MESSAGES, post, stream

GREEDY = {"temperature": 0, "ignore_eos": True}


def _completion(http: httpx.Client, **body: Any) -> dict[str, Any]:
    out = post(http, COMPLETIONS, body)
    CompletionResponse.model_validate(out)
    return out


def _streamed_tokens(events: list[dict[str, Any]], index: int = 0) -> list[int]:
    return [t for e in events for c in e["choices"] if c["index"] == index
            for t in c["token_ids"]]


def test_models(http: httpx.Client) -> None:
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny-moe"]
    assert data[0]["max_model_len"] == MAX_MODEL_LEN and data[0]["object"] == "model"


def test_completion(http: httpx.Client) -> None:
    r = http.post(COMPLETIONS, json={"model": "tiny-moe", "prompt": "Hello", "max_tokens": 7,
                                     **GREEDY})
    out = r.json()
    CompletionResponse.model_validate(out)
    assert out["id"].startswith("cmpl-") and r.headers["x-request-id"] == out["id"]
    choice = out["choices"][0]
    assert len(choice["token_ids"]) == 7 and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert choice["text"] == _decode(http, choice["token_ids"])


def _decode(http: httpx.Client, ids: list[int]) -> str:
    # the byte tokenizer: ids < 256 are bytes, others placeholders
    return b"".join(bytes([i]) if i < 256 else f"<|{i}|>".encode() for i in ids).decode(
        "utf-8", "replace")


def test_completion_stream_equals_non_stream(http: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 9, **GREEDY}
    whole = _completion(http, **body)["choices"][0]
    events = stream(http, COMPLETIONS, {**body, "stream_options": {"include_usage": True}})
    for e in events:
        CompletionStreamResponse.model_validate(e)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 9
    assert all(len(c["choices"]) == 1 and c["choices"][0]["token_ids"] for c in chunks)
    assert len({e["id"] for e in events}) == 1
    assert _streamed_tokens(chunks) == whole["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "length"]


def test_echo_begins_each_choice_with_its_prompt(http: httpx.Client) -> None:
    """echo: a text prompt as sent, a token-id prompt decoded, before each choice's completion
    (n choices each), streamed in each choice's first event; token_ids and usage unchanged."""
    body = {"prompt": ["Hello", "Bye"], "max_tokens": 4, "n": 2, **GREEDY}
    plain = _completion(http, **body)
    echoed = _completion(http, **body, echo=True)
    assert echoed["usage"] == plain["usage"]
    for i, (a, b) in enumerate(zip(plain["choices"], echoed["choices"], strict=True)):
        assert b["text"] == ["Hello", "Bye"][i // 2] + a["text"]
        assert b["token_ids"] == a["token_ids"]
    ids = _completion(http, prompt=[72, 105], max_tokens=3, echo=True, **GREEDY)["choices"][0]
    assert ids["text"] == "Hi" + _decode(http, ids["token_ids"])
    events = stream(http, COMPLETIONS, {**body, "echo": True})
    texts: dict[int, str] = {}
    firsts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c["text"])
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i: c["text"] for i, c in enumerate(echoed["choices"])}
    assert all(firsts[i].startswith(["Hello", "Bye"][i // 2]) for i in range(4))


def test_stream_without_usage_has_no_usage_chunk(http: httpx.Client) -> None:
    events = stream(http, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 3, **GREEDY})
    assert all(e["choices"] and "usage" not in e for e in events)
    assert len(_streamed_tokens(events)) == 3


def test_default_max_tokens(http: httpx.Client) -> None:
    out = _completion(http, prompt=[7, 8, 9], **GREEDY)
    assert out["usage"]["completion_tokens"] == 16  # OpenAI's completions default
    chat = post(http, CHAT, {"messages": MESSAGES, **GREEDY})
    prompt_tokens = chat["usage"]["prompt_tokens"]
    assert chat["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_tokens
    assert chat["choices"][0]["finish_reason"] == "length"


def test_chat(http: httpx.Client, live: LiveServer) -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": 6, **GREEDY}
    r = http.post(CHAT, json=body)
    out = r.json()
    ChatCompletionResponse.model_validate(out)
    assert out["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == out["id"]
    assert out["object"] == "chat.completion"
    tok = live.client.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True),
                        add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == 6 == len(out["choices"][0]["token_ids"])
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant"
    # the same prompt as token ids through /v1/completions gives the same reply
    same = _completion(http, prompt=prompt, max_tokens=6, **GREEDY)["choices"][0]
    assert message["content"] == same["text"]

    events = stream(http, CHAT, {**body, "stream_options": {"include_usage": True}})
    for e in events:
        ChatCompletionStreamResponse.model_validate(e)
        assert e["object"] == "chat.completion.chunk"
    role, *chunks, usage = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == message["content"]
    assert usage["usage"]["completion_tokens"] == len(_streamed_tokens(chunks)) == 6
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_text_parts_are_joined(http: httpx.Client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    a = post(http, CHAT, {"messages": parts, "max_tokens": 4, **GREEDY})
    b = post(http, CHAT, {"messages": joined, "max_tokens": 4, **GREEDY})
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_n_with_seed_is_n_seeded_requests(http: httpx.Client) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    both = _completion(http, **body, n=2, seed=123)
    single = [_completion(http, **body, seed=s)["choices"][0]["token_ids"] for s in (123, 124)]
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["token_ids"] for c in both["choices"]] == single
    assert single[0] != single[1]
    assert both["usage"]["completion_tokens"] == 16 and both["usage"]["prompt_tokens"] == 3

    events = stream(http, COMPLETIONS, {**body, "n": 2, "seed": 123,
                                        "stream_options": {"include_usage": True}})
    assert [_streamed_tokens(events, i) for i in (0, 1)] == single
    assert all(len(e["choices"]) == 1 for e in events[:-1])  # one choice per event
    assert events[-1]["usage"]["completion_tokens"] == 16


def test_list_of_prompts(http: httpx.Client) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    out = _completion(http, prompt=prompts, max_tokens=5, **GREEDY)
    singles = [_completion(http, prompt=p, max_tokens=5, **GREEDY)["choices"][0]["token_ids"]
               for p in prompts]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in out["choices"]] == singles
    assert out["usage"]["prompt_tokens"] == 8 and out["usage"]["completion_tokens"] == 15
    texts = _completion(http, prompt=["ab", "cde"], max_tokens=2, n=2, **GREEDY)
    assert [c["index"] for c in texts["choices"]] == [0, 1, 2, 3]
    assert texts["usage"]["prompt_tokens"] == 5  # each prompt counted once, not n times


def test_stop_string(http: httpx.Client) -> None:
    base = {"prompt": [3, 1, 4, 1, 5], **GREEDY}
    full = _completion(http, **base, max_tokens=30)["choices"][0]
    stop = _decode(http, [full["token_ids"][6]])
    cut = full["text"][:full["text"].index(stop)]
    out = _completion(http, **base, max_tokens=30, stop=[stop, "never-there"])["choices"][0]
    assert out["text"] == cut
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    events = stream(http, COMPLETIONS, {**base, "max_tokens": 30, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events) == cut
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_id(http: httpx.Client) -> None:
    base = {"prompt": [2, 7, 1, 8], **GREEDY}
    full = _completion(http, **base, max_tokens=20)["choices"][0]["token_ids"]
    stop_id = full[5]
    out = _completion(http, **base, max_tokens=20, stop_token_ids=[stop_id])["choices"][0]
    assert out["token_ids"] == full[:full.index(stop_id) + 1]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_id


def test_completion_logprobs(http: httpx.Client) -> None:
    out = _completion(http, prompt="Hey", max_tokens=6, logprobs=3, **GREEDY)["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["tokens"] == [_decode(http, [t]) for t in out["token_ids"]]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3 and value <= 0
        assert abs(max(top.values()) - value) < 1e-5  # greedy takes the most likely token
        assert token in top
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    events = stream(http, COMPLETIONS, {"prompt": "Hey", "max_tokens": 6, "logprobs": 3,
                                        **GREEDY})
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    assert [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]] == \
        lp["text_offset"]


def test_chat_logprobs(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, "logprobs": True, "top_logprobs": 2, **GREEDY}
    out = post(http, CHAT, body)
    ChatCompletionResponse.model_validate(out)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry, token_id in zip(content, out["choices"][0]["token_ids"]):
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert abs(entry["top_logprobs"][0]["logprob"] - entry["logprob"]) < 1e-5
        raw = bytes([token_id]) if token_id < 256 else f"<|{token_id}|>".encode()
        assert entry["bytes"] == list(raw)
    no_top = post(http, CHAT, {**body, "top_logprobs": 0})["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in no_top) and len(no_top) == 5
    plain = post(http, CHAT, {**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None


def test_echo_with_logprobs_begins_with_the_prompts(http: httpx.Client) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1): the
    legacy logprobs list the prompt's tokens first, the first one null, then the completion's;
    the prompt's values are those prompt_logprobs gives by id; streamed the same."""
    prompt = [72, 105, 33, 32, 119, 111]
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    choice = _completion(http, **body)["choices"][0]
    lps = choice["logprobs"]
    assert lps["tokens"] == [_decode(http, [t]) for t in prompt + choice["token_ids"]]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(v <= 0 for v in lps["token_logprobs"][1:])
    assert all(len(top) == 1 for top in lps["top_logprobs"][1:])
    assert lps["text_offset"] == [0, 1, 2, 3, 4, 5, 6]
    by_id = _completion(http, prompt=prompt, max_tokens=1, prompt_logprobs=2,
                        temperature=0)["choices"][0]
    assert by_id["logprobs"] is None and by_id["prompt_logprobs"][0] is None
    entries = by_id["prompt_logprobs"][1:]
    assert len(entries) == len(prompt) - 1
    for token, entry, value in zip(prompt[1:], entries, lps["token_logprobs"][1:6]):
        assert entry[str(token)]["logprob"] == value
        assert entry[str(token)]["decoded_token"] == _decode(http, [token])
        assert 2 <= len(entry) <= 3  # the prompt token and its top 2
    events = stream(http, COMPLETIONS, body)
    streamed = [c["logprobs"] for e in events for c in e["choices"]]
    assert streamed[0]["token_logprobs"] == lps["token_logprobs"]
    plain = _completion(http, prompt=prompt, max_tokens=1, temperature=0)["choices"][0]
    assert "prompt_logprobs" not in plain and plain["token_ids"] == choice["token_ids"]


def test_return_tokens_as_token_ids_names_tokens_by_id(http: httpx.Client) -> None:
    body = {"prompt": [72, 105], "max_tokens": 3, "logprobs": 2,
            "return_tokens_as_token_ids": True, **GREEDY}
    choice = _completion(http, **body)["choices"][0]
    lps = choice["logprobs"]
    assert lps["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in lps["top_logprobs"] for k in top)
    plain = _completion(http, **{**body, "return_tokens_as_token_ids": False})["choices"][0]
    assert lps["text_offset"] == plain["logprobs"]["text_offset"]  # offsets of the text
    chat = post(http, CHAT, {"messages": MESSAGES, "max_tokens": 2, "logprobs": True,
                             "top_logprobs": 1, "return_tokens_as_token_ids": True, **GREEDY})
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [
        f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert content[0]["top_logprobs"][0]["token"].startswith("token_id:")


def test_truncate_prompt_tokens_keeps_the_prompts_tail(http: httpx.Client) -> None:
    """The last N tokens of the prompt are served (usage counts them; echo shows them), a
    token-id prompt past max_model_len included; -1 keeps max_model_len - 1."""
    tail = [72, 105, 33]
    body = {"max_tokens": 3, **GREEDY}
    cut = _completion(http, prompt=[1, 2, 3, 4] + tail, truncate_prompt_tokens=3, echo=True,
                      **body)
    whole = _completion(http, prompt=tail, **body)
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"]
    assert cut["choices"][0]["text"].startswith("Hi!")
    long = [65] * (MAX_MODEL_LEN + 10)
    out = _completion(http, prompt=long, truncate_prompt_tokens=-1, max_tokens=1, **GREEDY)
    assert out["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    chat = post(http, CHAT, {"messages": MESSAGES, "truncate_prompt_tokens": 2, **body})
    assert chat["usage"]["prompt_tokens"] == 2
    bad = http.post(COMPLETIONS, json={"prompt": "x", "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
