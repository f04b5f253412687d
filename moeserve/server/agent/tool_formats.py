"""How each family writes tool calls, parsed from a reply and written back for the default
chat template. The names are vLLM's and SGLang's --tool-call-parser names.

    hermes (Qwen2.5, Qwen3):
        <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>, a block per call
    glm45 (GLM-4.5, 4.6), glm47 (GLM-4.7, GLM-5: the same with no newlines):
        <tool_call>N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>; a value
        is text when the schema makes it a string, else JSON when it parses as JSON
    deepseek_v3 (V3, R1), deepseek_v31 (V3.1), in one block of calls:
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```
        <｜tool▁call▁end｜> ... <｜tool▁calls▁end｜>   (V3.1: N<｜tool▁sep｜>{...} unfenced)
    deepseek_v32 (V3.2's DSML):
        <｜DSML｜function_calls>\n<｜DSML｜invoke name="N">\n<｜DSML｜parameter name="K"
        string="true|false">V</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>
    kimi_k2 (Kimi K2), the call's id is the model's "functions.N:I":
        <|tool_calls_section_begin|><|tool_call_begin|>functions.N:I
        <|tool_call_argument_begin|>{...}<|tool_call_end|> ... <|tool_calls_section_end|>
    mistral (Mixtral, Mistral): [TOOL_CALLS] [{"name": N, "arguments": {...}}, ...] to the end

(`｜` is U+FF5C, `▁` U+2581; the line breaks inside a marker above are the page's, not the
format's.) Each parser is lenient where the families' own parsers are (both DeepSeek forms parse
under either name, both GLM layouts under either) and strict about the result: a call needs a
name and an arguments object, or the block is given back as content.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeserve.server.agent.tool_splitter import ParsedCall, ToolCallError, ToolFormat

Calls = list[tuple[str, dict[str, Any]]]


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ToolCallError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ToolCallError(f"{what} is not a JSON object")
    return value


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _name_and_arguments(call: Any) -> tuple[str, dict[str, Any]]:
    """{"name": ..., "arguments": {...} or its JSON text} (hermes, mistral)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError("a call without a name")
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        args = _json_object(args, "the arguments")
    if not isinstance(args, dict):
        raise ToolCallError("arguments that are not an object")
    return call["name"], args


def _schema_types(schema: dict[str, Any] | None) -> set[str]:
    """The JSON types a parameter's schema allows (type, anyOf/oneOf, enum values)."""
    if not isinstance(schema, dict):
        return set()
    types = schema.get("type")
    out = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            out |= _schema_types(option)
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        out.add("string")
    return out


def _typed_value(raw: str, tools: Mapping[str, dict[str, Any]], function: str, key: str) -> Any:
    """A value the model wrote as text: kept as text when the function's schema makes the
    parameter a string (only), else decoded as JSON when it is JSON, else kept as text."""
    properties = (tools.get(function) or {}).get("properties") or {}
    if _schema_types(properties.get(key)) == {"string"}:
        return raw
    try:
        return json.loads(raw.strip())
    except ValueError:
        return raw


@dataclass(frozen=True)
class Hermes:
    name: str = "hermes"
    start: str = "<tool_call>"
    end: str | None = "</tool_call>"
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        try:
            call = json.loads(block)
        except ValueError as e:
            raise ToolCallError(f"a call that is not JSON: {e}") from None
        return [ParsedCall(*_name_and_arguments(call))]

    def render(self, calls: Calls) -> str:
        return "\n".join(f'{self.start}\n{{"name": {_dump(n)}, "arguments": {_dump(a)}}}\n'
                         f'{self.end}' for n, a in calls)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclass(frozen=True)
class Glm:
    name: str = "glm45"
    compact: bool = False  # glm47: no newlines between the parts
    start: str = "<tool_call>"
    end: str | None = "</tool_call>"
    markers: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                "<arg_value>", "</arg_value>")

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        head, _, _ = block.partition("<arg_key>")
        name = head.strip()
        if not name or any(c.isspace() for c in name):
            raise ToolCallError("a call without a one-word name")
        args_text = block[len(head):]
        pairs = _GLM_ARG.findall(args_text)
        if _GLM_ARG.sub("", args_text).strip():
            raise ToolCallError("text between the arguments")
        return [ParsedCall(name, {k.strip(): _typed_value(v, tools, name, k.strip())
                                  for k, v in pairs})]

    def render(self, calls: Calls) -> str:
        sep = "" if self.compact else "\n"
        out = []
        for name, args in calls:
            parts = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>"
                            f"{v if isinstance(v, str) else _dump(v)}</arg_value>{sep}"
                            for k, v in args.items())
            out.append(f"{self.start}{name}{sep}{parts}{self.end}")
        return sep.join(out)


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>",
                      re.DOTALL)
_DS_FENCED = re.compile(r"(.*?)\n```json\n(.*)\n```\s*", re.DOTALL)


@dataclass(frozen=True)
class DeepSeek:
    name: str = "deepseek_v3"
    fenced: bool = True  # V3 / R1: "function<sep>NAME\n```json ...```"; V3.1: "NAME<sep>{...}"
    start: str = "<｜tool▁calls▁begin｜>"
    end: str | None = "<｜tool▁calls▁end｜>"
    markers: tuple[str, ...] = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        calls = []
        for head, body in _DS_CALL.findall(block):
            fenced = _DS_FENCED.fullmatch(body)
            if fenced is not None:  # V3's form: the head is the call's type
                name, args = fenced.group(1).strip(), fenced.group(2)
            else:
                name, args = head.strip(), body
            calls.append(ParsedCall(name, _json_object(args, "the arguments")))
        if _DS_CALL.sub("", block).strip():
            raise ToolCallError("text between the calls")
        return calls

    def render(self, calls: Calls) -> str:
        if self.fenced:
            body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n"
                             f"{_dump(a)}\n```<｜tool▁call▁end｜>" for n, a in calls)
        else:
            body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_dump(a)}<｜tool▁call▁end｜>"
                           for n, a in calls)
        return f"{self.start}{body}{self.end}"


_DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAM = re.compile(
    r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.DOTALL)


@dataclass(frozen=True)
class Dsml:
    name: str = "deepseek_v32"
    start: str = "<｜DSML｜function_calls>"
    end: str | None = "</｜DSML｜function_calls>"
    markers: tuple[str, ...] = ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
                                "<｜DSML｜invoke", "</｜DSML｜invoke>", "<｜DSML｜parameter",
                                "</｜DSML｜parameter>")

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        calls = []
        for name, body in _DSML_INVOKE.findall(block):
            args: dict[str, Any] = {}
            for key, is_text, value in _DSML_PARAM.findall(body):
                if is_text == "true":
                    args[key] = value
                else:
                    try:
                        args[key] = json.loads(value)
                    except ValueError as e:
                        raise ToolCallError(f"parameter {key!r} is not JSON: {e}") from None
            if _DSML_PARAM.sub("", body).strip():
                raise ToolCallError("text between the parameters")
            calls.append(ParsedCall(name, args))
        if _DSML_INVOKE.sub("", block).strip():
            raise ToolCallError("text between the calls")
        return calls

    def render(self, calls: Calls) -> str:
        out = [f"{self.start}\n"]
        for name, args in calls:
            out.append(f'<｜DSML｜invoke name="{name}">\n')
            for k, v in args.items():
                text = isinstance(v, str)
                out.append(f'<｜DSML｜parameter name="{k}" string="{str(text).lower()}">'
                           f"{v if text else _dump(v)}</｜DSML｜parameter>\n")
            out.append("</｜DSML｜invoke>\n")
        return "".join(out) + self.end


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)"
                        r"<\|tool_call_end\|>", re.DOTALL)


@dataclass(frozen=True)
class KimiK2:
    name: str = "kimi_k2"
    start: str = "<|tool_calls_section_begin|>"
    end: str | None = "<|tool_calls_section_end|>"
    markers: tuple[str, ...] = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                "<|tool_call_end|>")

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        calls = []
        for call_id, args in _KIMI_CALL.findall(block):
            call_id = call_id.strip()
            name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
            calls.append(ParsedCall(name, _json_object(args, "the arguments"), call_id))
        if _KIMI_CALL.sub("", block).strip():
            raise ToolCallError("text between the calls")
        return calls

    def render(self, calls: Calls) -> str:
        body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
                       f"{_dump(a)}<|tool_call_end|>" for i, (n, a) in enumerate(calls))
        return f"{self.start}{body}{self.end}"


@dataclass(frozen=True)
class Mistral:
    name: str = "mistral"
    start: str = "[TOOL_CALLS]"
    end: str | None = None  # the calls run to the end of the reply
    markers: tuple[str, ...] = ("[TOOL_CALLS]",)

    def parse(self, block: str, tools: Mapping[str, dict[str, Any]]) -> list[ParsedCall]:
        try:
            calls = json.loads(block)
        except ValueError as e:
            raise ToolCallError(f"the calls are not JSON: {e}") from None
        if isinstance(calls, dict):
            calls = [calls]
        if not isinstance(calls, list):
            raise ToolCallError("the calls are not a JSON list")
        # Mistral's templates accept only ids of 9 letters and digits
        return [ParsedCall(*_name_and_arguments(c), mistral_call_id()) for c in calls]

    def render(self, calls: Calls) -> str:
        return self.start + " " + _dump([{"name": n, "arguments": a} for n, a in calls])


def mistral_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    Hermes(), Glm(), Glm("glm47", compact=True), DeepSeek(), DeepSeek("deepseek_v31", False),
    Dsml(), KimiK2(), Mistral())}
TOOL_FORMAT_ALIASES = {"qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes", "glm": "glm45",
                       "glm4_moe": "glm45", "deepseekv3": "deepseek_v3",
                       "deepseekv31": "deepseek_v31", "deepseekv32": "deepseek_v32",
                       "kimi": "kimi_k2"}
