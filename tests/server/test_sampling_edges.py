"""Issue 12's sampling reproducers over HTTP: values inside the API's ranges that round to 0 in
fp32 get the greedy answer (they crashed the engine, or returned token 0 repeated), and the next
request is served."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import CHAT, COMPLETIONS, MESSAGES, post

EDGES = [{"top_p": 1e-46}, {"temperature": 1e-39, "top_p": 0.9}, {"temperature": 1e-39},
         {"top_p": 5e-324}, {"top_p": 0}, {"temperature": 9e-6, "top_k": 3, "min_p": 1e-300}]


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "hi"}),
                                       (CHAT, {"messages": MESSAGES})])
@pytest.mark.parametrize("edge", EDGES, ids=[str(e) for e in EDGES])
def test_sampling_values_that_round_to_zero_give_the_greedy_answer(
        http: httpx.Client, path: str, body: dict, edge: dict) -> None:
    request = {**body, "max_tokens": 6, "ignore_eos": True}
    greedy = post(http, path, {**request, "temperature": 0})["choices"][0]["token_ids"]
    assert post(http, path, {**request, **edge})["choices"][0]["token_ids"] == greedy
    assert post(http, path, {**request, "temperature": 0})["choices"][0]["token_ids"] == greedy
    assert http.get("/ready").status_code == 200


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "hi"}),
                                       (CHAT, {"messages": MESSAGES})])
def test_logit_bias_forces_and_bans_tokens(http: httpx.Client, path: str, body: dict) -> None:
    """+100 on a token makes greedy (and sampled) replies that token alone; -100 on the greedy
    reply's first token takes it out of the first position; {} and null change nothing."""
    request = {**body, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    greedy = post(http, path, request)["choices"][0]["token_ids"]
    for neutral in ({}, None):
        assert post(http, path, {**request, "logit_bias": neutral})["choices"][0][
            "token_ids"] == greedy
    forced = post(http, path, {**request, "logit_bias": {"77": 100}})["choices"][0]
    assert forced["token_ids"] == [77] * 5
    sampled = post(http, path, {**request, "temperature": 1.0, "seed": 4, "n": 2,
                                "logit_bias": {"77": 100}})
    assert all(c["token_ids"] == [77] * 5 for c in sampled["choices"])
    banned = post(http, path, {**request, "logit_bias": {str(greedy[0]): -100}})
    assert banned["choices"][0]["token_ids"][0] != greedy[0]


def test_penalties_are_served(http: httpx.Client) -> None:
    """presence / frequency penalties in [-2, 2] reach the engine (their arithmetic:
    tests/engine/test_logit_bias.py): at 0 nothing changes, and a repeating greedy reply
    (tiny-moe's to token ids 5, 6 repeats after 18 tokens) changes under a frequency penalty."""
    request = {"prompt": [5, 6], "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    greedy = post(http, COMPLETIONS, request)["choices"][0]["token_ids"]
    zero = {**request, "presence_penalty": 0.0, "frequency_penalty": 0}
    assert post(http, COMPLETIONS, zero)["choices"][0]["token_ids"] == greedy
    chat = post(http, CHAT, {"messages": MESSAGES, "max_tokens": 4, "presence_penalty": -2,
                             "frequency_penalty": 2})
    assert chat["choices"][0]["message"]["content"] is not None
    if len(set(greedy)) < len(greedy):
        for penalty in ({"frequency_penalty": 2.0}, {"repetition_penalty": 1.8}):
            penalized = {**request, **penalty}
            assert post(http, COMPLETIONS, penalized)["choices"][0]["token_ids"] != greedy
    assert post(http, COMPLETIONS, {**request, "repetition_penalty": 1})["choices"][0][
        "token_ids"] == greedy
    assert http.get("/v1/engine").json()["server"]["sampling_defaults"] == {}


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "hi"}),
                                       (CHAT, {"messages": MESSAGES})])
def test_min_tokens_holds_eos_and_stop_strings(http: httpx.Client, path: str,
                                               body: dict) -> None:
    """A stop string ("M", token 77's text, the greedy token under a +100 bias) counts only
    where it ends past the first min_tokens tokens; a stop id made the greedy token is held
    off the first min_tokens positions, then sampled."""
    request = {**body, "max_tokens": 8, "temperature": 0}
    stopped = post(http, path, {**request, "logit_bias": {"77": 100}, "stop": "M",
                                "min_tokens": 3})["choices"][0]
    text = stopped["text"] if path == COMPLETIONS else stopped["message"]["content"]
    assert text == "MMM" and stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == "M"
    kept = post(http, path, {**request, "logit_bias": {"77": 100}, "stop": "MM",
                             "include_stop_str_in_output": True, "min_tokens": 2})["choices"][0]
    text = kept["text"] if path == COMPLETIONS else kept["message"]["content"]
    assert text == "MMM" and kept["stop_reason"] == "MM"  # the stop ends at the 3rd token
    held = post(http, path, {**request, "logit_bias": {"77": 100}, "stop_token_ids": [77],
                             "min_tokens": 5})["choices"][0]
    assert len(held["token_ids"]) == 6 and 77 not in held["token_ids"][:5]
    assert held["token_ids"][5] == 77 and held["finish_reason"] == "stop"
