"""No one request blocks the API process's event loop: its size is checked before any
tokenization, and a large request is tokenized off the loop (server/routes/request_limits.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.server.routes.request_limits import BIG_BODY_BYTES, count_array_elements
from tests.server.conftest import MAX_MODEL_LEN, LiveServer
from tests.server.helpers import COMPLETIONS


class SpyTokenizer:
    """The server's tokenizer, counting encode calls; `hold` makes the next call wait."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_encodes = 0
        self.hold: threading.Event | None = None
        self.entered = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_encodes += 1
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(60), "the test never released the tokenizer"
        return self.inner.encode(text, add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture()
def spy(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[SpyTokenizer]:
    tokenizer = SpyTokenizer(live.client.tokenizer)
    monkeypatch.setattr(live.client, "tokenizer", tokenizer)
    yield tokenizer


def test_a_20_mb_body_of_prompts_is_refused_before_any_tokenization(
        http: httpx.Client, spy: SpyTokenizer) -> None:
    body = json.dumps({"prompt": ["hi"] * 3_400_000, "max_tokens": 1}).encode()
    assert len(body) > 20_000_000
    r = http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "n x number of prompts is 3400000" in r.json()["error"]["message"]
    assert spy.num_encodes == 0
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": "x" * (BIG_BODY_BYTES + 10)}, "prompt", "characters, more than max_model_len"),
    ({"prompt": ["y" * 300] * 10}, "prompt", "prompt 0: the text has 300 characters"),
    ({"prompt": [1] * (BIG_BODY_BYTES // 2)}, "prompt", "max_model_len is 128"),
    ({"prompt": [[1, 2]] * 300}, "n", "n x number of prompts is 300"),
    ({"prompt": ["a,b\\\",c"] * 100, "n": 3}, "n", "n x number of prompts is 300"),
])
def test_a_prompt_too_long_in_characters_or_too_many_is_refused_untokenized(
        http: httpx.Client, spy: SpyTokenizer, body: dict, param: str, needle: str) -> None:
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and needle in r.json()["error"]["message"]
    assert spy.num_encodes == 0


def test_chat_with_more_messages_than_the_context_is_refused_unrendered(
        http: httpx.Client, spy: SpyTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}] * (MAX_MODEL_LEN + 1)
    r = http.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert spy.num_encodes == 0


def test_health_answers_while_a_large_request_is_being_tokenized(
        http: httpx.Client, spy: SpyTokenizer, live: LiveServer) -> None:
    spy.hold = threading.Event()
    prompts = ["z" * 100] * 200  # 20,000 characters in all: tokenized off the event loop
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            result["r"] = client.post(COMPLETIONS, json={"prompt": prompts, "max_tokens": 1})

    poster = threading.Thread(target=post)
    poster.start()
    try:
        assert spy.entered.wait(60), "the request never reached the tokenizer"
        assert http.get("/health").status_code == 200  # the loop answers meanwhile
        assert http.get("/ready").status_code == 200
        assert "r" not in result  # still held in the tokenizer
    finally:
        spy.hold.set()
        poster.join(60)
    assert result["r"].status_code == 200, result["r"].text
    assert len(result["r"].json()["choices"]) == 200


_json_text = st.text(alphabet=st.sampled_from('ab,[]{}"\\: \n'), max_size=8)
_leaf = st.one_of(st.integers(-5, 5), _json_text, st.booleans(), st.none())
_value = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_json_text, inner, max_size=3)), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(_value, max_size=12), indent=st.sampled_from([None, 1]))
def test_count_array_elements_matches_a_json_parse(items: list, indent: int | None) -> None:
    raw = json.dumps(items, indent=indent).encode()
    assert count_array_elements(raw) == len(items)


def test_count_array_elements_of_what_is_not_an_array() -> None:
    assert count_array_elements(b'"a,b"') == 0
    assert count_array_elements(b"3") == 0
    assert count_array_elements(b"[ ]") == 0
