"""POST /tokenize and /detokenize (vLLM's routes) on the live server (tiny-moe, byte tokenizer):
a chat's ids are as many as /v1/chat/completions submits for it (its usage's prompt_tokens),
without the generation prompt a prefix of them; a prompt's are the tokenizer's; the ids come
back as the text; bad bodies are 400s naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import CHAT, post

CHAT_BODY = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]}


def test_a_chat_tokenizes_as_the_chat_route_renders_it(http: httpx.Client) -> None:
    reply = post(http, CHAT, {**CHAT_BODY, "max_tokens": 1})
    ids = post(http, "/tokenize", {"model": "tiny-moe", **CHAT_BODY})
    assert ids["count"] == len(ids["tokens"]) == reply["usage"]["prompt_tokens"]
    assert ids["max_model_len"] > 0 and ids["token_strs"] is None
    bare = post(http, "/tokenize", {**CHAT_BODY, "add_generation_prompt": False})
    assert bare["tokens"] == ids["tokens"][:bare["count"]] and bare["count"] < ids["count"]
    text = post(http, "/detokenize", {"tokens": ids["tokens"]})["prompt"]
    assert text.endswith(post(http, "/detokenize", {"tokens": ids["tokens"][bare["count"]:]})[
        "prompt"]) and "Hi" in text


def test_a_prompt_tokenizes_to_the_tokenizers_ids_and_back(http: httpx.Client) -> None:
    out = post(http, "/tokenize", {"prompt": "héllo", "return_token_strs": True})
    assert out["tokens"] == list("héllo".encode()) and out["count"] == 6  # byte tokenizer
    assert out["token_strs"][0] == "h" and "\ufffd" in out["token_strs"][1]  # half of é
    assert post(http, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": "héllo"}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "give exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "x", **CHAT_BODY}, "give exactly one"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "goes with messages"),
    ("/tokenize", {**CHAT_BODY, "chat_template_kwargs": {"tools": []}}, "set by the server"),
    ("/tokenize", {"prompt": "x", "echo": True}, "unsupported field 'echo'"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]: the id 1000000000 is outside"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]: Input should be greater than or equal to 0"),
])
def test_bad_bodies_are_named(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400 and param in r.json()["error"]["message"], r.text


def test_an_unknown_model_is_a_404(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
