"""Which tool-call and reasoning formats a server parses, and why: `--tool-call-parser` and
`--reasoning-parser`, each a name (vLLM's and SGLang's names are accepted), "none", or "auto".

"auto" reads the model's own chat template, the text the model was trained to answer: the
tool-call markers it writes into assistant turns name the format (DeepSeek's <｜tool▁sep｜>,
GLM's <arg_key>, Qwen's <tool_call>, ...), and a template that mentions <think> has reasoning.
A checkpoint with no template (the presets, served with the byte tokenizer and the default
template) gets its family's format by architecture. The choice and its reason are shown at
/v1/engine, so a request refused for want of a format says what the server chose and how to
change it.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from moeserve.server.agent.reasoning import ReasoningFormat
from moeserve.server.agent.strict_calls import SUPPORTED as STRICT_FORMATS
from moeserve.server.agent.tool_formats import TOOL_FORMAT_ALIASES, TOOL_FORMATS
from moeserve.server.agent.tool_splitter import ToolFormat

REASONING_NAMES = ("qwen3", "deepseek_r1", "deepseek_v3", "glm45", "glm47", "kimi_k2", "think")
REASONING_ALIASES = {"deepseek-r1": "deepseek_r1", "deepseek-v3": "deepseek_v3", "kimi": "kimi_k2",
                     "qwen3-thinking": "qwen3"}
TOOL_PARSER_CHOICES = ("auto", "none", *TOOL_FORMATS, *TOOL_FORMAT_ALIASES)
REASONING_PARSER_CHOICES = ("auto", "none", *REASONING_NAMES, *REASONING_ALIASES)

# Checked in order: the first marker the template holds names the format.
_TEMPLATE_MARKERS = (
    ("<｜DSML｜", "deepseek_v32"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<｜tool▁sep｜>", "deepseek_v3"),  # "deepseek_v31" when the template has no ```json fence
    ("<arg_key>", "glm45"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
)
_ARCHITECTURE_TOOLS = {
    "Qwen3MoeForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes", "Glm4MoeForCausalLM": "glm45",
    "Glm4MoeLiteForCausalLM": "glm47", "GlmMoeDsaForCausalLM": "glm47",
    "DeepseekV2ForCausalLM": "deepseek_v3", "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32", "MixtralForCausalLM": "mistral",
}
_NO_REASONING_ARCHITECTURES = ("MixtralForCausalLM",)


@dataclass(frozen=True)
class AgentFormats:
    tools: ToolFormat | None
    tools_reason: str
    reasoning: ReasoningFormat | None
    reasoning_reason: str
    keep_special_tokens: bool = False
    """Some marker is a special token of the tokenizer: replies that are parsed keep them."""
    strict_auto: str = "no tool-call format"
    """Whether strict tools hold tool_choice "auto" calls to their schemas here
    (agent/strict_calls.py): "enforced", or why not."""

    def describe(self) -> dict[str, Any]:
        return {"tool_call_parser": self.tools.name if self.tools else "none",
                "tool_call_parser_reason": self.tools_reason,
                "reasoning_parser": self.reasoning.name if self.reasoning else "none",
                "reasoning_parser_reason": self.reasoning_reason,
                "keep_special_tokens": self.keep_special_tokens,
                "strict_tools_under_auto": self.strict_auto}


def choose_formats(tool_parser: str, reasoning_parser: str, tokenizer: Any,
                   architecture: str) -> AgentFormats:
    """Resolve the two flags for this tokenizer (its `chat_template`, None for the default
    one) and architecture. An unknown name raises ValueError naming the flag."""
    template = getattr(tokenizer, "chat_template", None)
    tools, tools_reason = _tool_format(tool_parser, template, architecture)
    reasoning, reasoning_reason = _reasoning_format(reasoning_parser, template, architecture)
    markers = [*(tools.markers if tools else ()),
               *((reasoning.start, reasoning.end) if reasoning else ())]
    keep = any(is_special_marker(tokenizer, m) for m in markers)
    return AgentFormats(tools, tools_reason, reasoning, reasoning_reason, keep,
                        _strict_auto(tools, tokenizer))


def _strict_auto(tools: ToolFormat | None, tokenizer: Any) -> str:
    if tools is None:
        return "no tool-call format"
    if tools.name not in STRICT_FORMATS:
        return f"not enforced: {tools.name}'s calls are not one JSON object between text markers"
    if is_special_marker(tokenizer, tools.start):
        return f"not enforced: {tools.start!r} is a special token of the tokenizer"
    return "enforced"


def _tool_format(flag: str, template: str | None, architecture: str
                 ) -> tuple[ToolFormat | None, str]:
    if flag != "auto":
        name, reason = _named("--tool-call-parser", flag, TOOL_FORMAT_ALIASES, TOOL_FORMATS,
                              TOOL_PARSER_CHOICES)
        return (TOOL_FORMATS[name] if name else None), reason
    if template is None:
        name = _ARCHITECTURE_TOOLS.get(architecture)
        if name is None:
            return None, f"auto: no chat template, and no known format for {architecture}"
        return TOOL_FORMATS[name], (f"auto: no chat template; {architecture}'s format (the "
                                    f"default template writes calls in it)")
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            if name == "deepseek_v3" and "```json" not in template:
                name = "deepseek_v31"
            if name == "glm45" and not any(s in template for s in (
                    "</arg_key>\n<arg_value>", "</arg_key>\\n<arg_value>")):
                name = "glm47"
            return TOOL_FORMATS[name], f"auto: the chat template writes {marker}"
    return None, ("auto: the chat template writes no tool-call format moeserve knows; name one "
                  "with --tool-call-parser")


def _reasoning_format(flag: str, template: str | None, architecture: str
                      ) -> tuple[ReasoningFormat | None, str]:
    if flag != "auto":
        name, reason = _named("--reasoning-parser", flag, REASONING_ALIASES, REASONING_NAMES,
                              REASONING_PARSER_CHOICES)
        return (ReasoningFormat(name) if name else None), reason
    if template is None:
        if architecture in _NO_REASONING_ARCHITECTURES:
            return None, f"auto: no chat template, and {architecture} does not reason"
        return ReasoningFormat("think"), f"auto: no chat template; {architecture} reasons"
    if "<think>" in template:
        return ReasoningFormat("think"), "auto: the chat template writes <think>"
    return None, "auto: the chat template writes no <think>"


def _named(option: str, flag: str, aliases: dict[str, str], known: Container[str],
           choices: tuple[str, ...]) -> tuple[str | None, str]:
    """A flag that names a format (or "none"): the format's name, and the reason."""
    if flag == "none":
        return None, f"{option} none"
    name = aliases.get(flag, flag)
    if name not in known:
        raise ValueError(f"{option} {flag!r} is unknown; known: {', '.join(choices)}")
    return name, f"{option} {flag}"


def is_special_marker(tokenizer: Any, marker: str) -> bool:
    """Whether the marker's text is lost when special tokens are skipped."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return (tokenizer.decode(ids, skip_special_tokens=True)
            != tokenizer.decode(ids, skip_special_tokens=False))
