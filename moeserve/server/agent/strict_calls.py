"""tool_choice "auto" with strict tools: the reply's text is free, and each tool call it writes
is held to its tool's schema (SGLang's structural tags for tool calls; vLLM holds arguments to
their schemas only when a call is forced, forced_calls.py).

    hermes:  text  (<tool_call>\\n {"name": N, "arguments": A} \\n</tool_call>  text)*
             N one of the offered functions; A valid under N's parameters when N is strict,
             any object when it is not; with parallel_tool_calls false at most one call

One Lark grammar (llguidance's dialect): the text before a call is a lazy rule that ends at the
call's opener (its `suffix`, written out), the text after the last call a lexeme that cannot
contain the opener, so a call the model opens is held to the grammar and text that never opens
one is any text. JSON is written compact, as every grammar of the server's writes it
(structured/spec.py). The reply is read back by the format's own parser, as with auto.

When the prompt ends inside the model's reasoning, the grammar starts after its end marker
(chat_output's start_after); a reasoning block the reply writes itself is text to the grammar,
so a call opened inside it is held to the schemas too (llguidance's lazy rule commits at the
first opener: the grammar cannot leave the block's text free and the reply's calls held).

Formats whose calls are one JSON object between plain-text markers take it (`SUPPORTED`);
where the markers are special tokens of the tokenizer (text cannot spell them) or the format
writes arguments as other than JSON (GLM's, DSML), strict tools are accepted and not enforced.
"""

from __future__ import annotations

import json

from moeserve.server.agent.forced_calls import ANY_OBJECT
from moeserve.server.agent.protocol import Tool
from moeserve.structured.spec import StructuredOutput

SUPPORTED = ("hermes",)
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def strict_calls_output(format_name: str | None, opener: str, closer: str | None,
                        tools: list[Tool], parallel: bool) -> StructuredOutput | None:
    """The grammar of a reply under tool_choice "auto" (the module docstring), or None when
    no tool is strict or the format does not take it."""
    if format_name not in SUPPORTED or closer is None or not any(
            t.function.strict for t in tools):
        return None
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": (t.function.parameters or ANY_OBJECT)
                             if t.function.strict else ANY_OBJECT}}
             for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    text_rule = "(text call)+" if parallel else "text call"
    lines = [f"start: TAIL | {text_rule} TAIL",
             f"text[suffix={json.dumps(opener)}]: /(?s:.*)/",
             f"TAIL: /(?s:.*)/ & ~/(?s:.*{_regex_literal(opener)}.*)/",
             f'call: "\\n" body {json.dumps(chr(10) + closer)}',
             "body: %json " + json.dumps(schema, separators=(",", ":"))]
    return StructuredOutput("grammar", "\n".join(lines))


def _regex_literal(text: str) -> str:
    """`text` as a regex matching itself (inside /.../: a slash escaped too)."""
    return "".join("\\" + c if c in _REGEX_META or c == "/" else c for c in text)

