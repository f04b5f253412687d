"""The reasoning and tool-call splitters: the same parts for any chunking of a reply (so a
stream's deltas join up to the whole reply), markers split across deltas, what is held and
released, and nothing lost."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve.server.agent.reasoning import ReasoningFormat, ReasoningSplitter
from moeserve.server.agent.reply import ReplyParser
from moeserve.server.agent.tool_formats import TOOL_FORMATS
from moeserve.server.agent.tool_splitter import ToolCallSplitter
from tests.server.agent.test_tool_formats import SCHEMAS, WRITTEN

THINK = ReasoningFormat("think")


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def reason(text: str, cuts: list[int] = (), inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, inside)
    reasoning = content = ""
    for chunk in _chunks(text, list(cuts)):
        r, c = splitter.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


def test_reasoning_cases() -> None:
    assert reason("<think>\nweigh it\n</think>\n\nThe answer.") == ("weigh it\n", "The answer.")
    assert reason("  <think>a</think>b") == ("a", "b")
    assert reason("The answer, no reasoning.") == ("", "The answer, no reasoning.")
    assert reason("  plain") == ("", "  plain")  # content keeps its leading whitespace
    assert reason("<think>cut off mid-thou") == ("cut off mid-thou", "")
    assert reason("<thin") == ("", "<thin")  # never became the marker: content
    assert reason("a</think>b <think>c</think>") == ("", "a</think>b <think>c</think>")
    # the template opened the reasoning (DeepSeek-R1, GLM-4.7): no start marker in the reply
    assert reason("weigh it</think>answer", inside=True) == ("weigh it", "answer")
    assert reason("all reasoning", inside=True) == ("all reasoning", "")
    assert reason("</think>\n\nanswer", inside=True) == ("", "answer")


def test_a_prompt_that_opens_the_reasoning() -> None:
    assert THINK.starts_inside("<|assistant|><think>\n")
    assert not THINK.starts_inside("<|assistant|></think>")
    assert not THINK.starts_inside("<|im_start|>assistant\n")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["<think>\nabc</think>\n\nxyz", "x<think>y</think>", "<think></think>",
                        " \n<think>日本</think>語 ", "</think>a</think>b", "<thi", "plain"]),
       st.booleans(), st.lists(st.integers(0, 40), max_size=8))
def test_reasoning_is_the_same_for_any_chunking(text: str, inside: bool,
                                                cuts: list[int]) -> None:
    assert reason(text, cuts, inside) == reason(text, (), inside)


def tools(name: str, text: str, cuts: list[int] = ()) -> tuple[str, list[tuple]]:
    splitter = ToolCallSplitter(TOOL_FORMATS[name], SCHEMAS)
    content, calls = "", []
    for chunk in _chunks(text, list(cuts)):
        c, more = splitter.feed(chunk)
        content, calls = content + c, calls + more
    c, more = splitter.finish()
    return content + c, [(x.name, x.arguments) for x in calls + more]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(WRITTEN)), st.sampled_from(["", "Let me check. \n", "日本 "]),
       st.sampled_from(["", "\n", "\nDone.", " <tool", "<|tool"]),
       st.lists(st.integers(0, 400), max_size=10))
def test_tool_calls_are_the_same_for_any_chunking(name: str, before: str, after: str,
                                                  cuts: list[int]) -> None:
    text = before + WRITTEN[name] + after
    whole = tools(name, text)
    assert tools(name, text, cuts) == whole
    if name == "mistral" and after.strip():  # its block runs to the end: no JSON then
        assert whole == (text, [])
        return
    assert len(whole[1]) == 2
    assert whole[0] == before.rstrip() + (after if after.strip() else "")


def test_content_is_released_as_soon_as_it_cannot_start_a_marker() -> None:
    splitter = ToolCallSplitter(TOOL_FORMATS["hermes"], SCHEMAS)
    assert splitter.feed("Hello <tool") == ("Hello", [])  # a marker's start and the space held
    assert splitter.feed("box") == (" <toolbox", [])
    assert splitter.feed("\n\n") == ("", [])
    assert splitter.finish() == ("\n\n", [])  # no call: trailing whitespace is content


def test_reply_parser_keeps_calls_inside_reasoning_as_reasoning() -> None:
    call = WRITTEN["hermes"]
    parser = ReplyParser(ReasoningSplitter(THINK, False),
                         ToolCallSplitter(TOOL_FORMATS["hermes"], SCHEMAS))
    part = parser.feed(f"<think>maybe {call}</think>Calling.\n{call}", final=True)
    assert part.reasoning == f"maybe {call}" and part.content == "Calling."
    assert [c["function"]["name"] for c in part.calls] == ["get_weather", "get_time"]
    assert part.calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'
    assert part.calls[0]["id"].startswith("call_") and part.calls[0]["type"] == "function"
    assert len({c["id"] for c in part.calls}) == 2 and parser.num_calls == 2
