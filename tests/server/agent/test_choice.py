"""Which formats a server parses: "auto" from the chat template's markers or the architecture,
names and aliases, errors naming the flag, special-token markers; and a checkpoint's template
rendered with tools, a history of calls and chat_template_kwargs exactly as transformers
renders it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken

from moeserve.server.agent.choice import TOOL_PARSER_CHOICES, choose_formats
from moeserve.server.agent.tool_formats import TOOL_FORMATS
from moeserve.tokenizer import ByteTokenizer, HFTokenizer
from tests.test_tokenizer import _write_bpe

BYTES = ByteTokenizer(512, None, None)


class _Templated(ByteTokenizer):
    def __init__(self, template: str) -> None:
        super().__init__(512, None, None)
        self.chat_template = template


@pytest.mark.parametrize("template,tools,reasoning", [
    ("{{ '<tool_call>\\n' + tc | tojson }}<think>", "hermes", "think"),
    ("{{ '<tool_call>' + name + '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' }}", "glm45",
     None),
    ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key><arg_value>", "glm47", None),
    ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ n }}\\n```json\\n", "deepseek_v3", None),
    ("<｜tool▁call▁begin｜>{{ n }}<｜tool▁sep｜>{{ a }}", "deepseek_v31", None),
    ("<|tool_calls_section_begin|><|tool_call_begin|> <think>", "kimi_k2", "think"),
    ("[AVAILABLE_TOOLS] [TOOL_CALLS] ", "mistral", None),
    ("{{ messages }}", None, None),
])
def test_auto_reads_the_chat_template(template: str, tools: str | None,
                                      reasoning: str | None) -> None:
    agent = choose_formats("auto", "auto", _Templated(template), "Qwen3MoeForCausalLM")
    assert (agent.tools.name if agent.tools else None) == tools
    assert (agent.reasoning.name if agent.reasoning else None) == reasoning
    assert agent.tools_reason.startswith("auto: the chat template writes")
    if tools is None:
        assert "--tool-call-parser" in agent.tools_reason


def test_auto_without_a_template_goes_by_architecture() -> None:
    for arch, name in (("Qwen3MoeForCausalLM", "hermes"), ("Glm4MoeLiteForCausalLM", "glm47"),
                       ("DeepseekV3ForCausalLM", "deepseek_v3"),
                       ("GlmMoeDsaForCausalLM", "glm47"), ("MixtralForCausalLM", "mistral")):
        agent = choose_formats("auto", "auto", BYTES, arch)
        assert agent.tools is TOOL_FORMATS[name] and "no chat template" in agent.tools_reason
        assert (agent.reasoning is None) == (arch == "MixtralForCausalLM")
    assert choose_formats("auto", "auto", BYTES, "OtherForCausalLM").tools is None


def test_names_aliases_none_and_errors() -> None:
    for flag in TOOL_PARSER_CHOICES:
        if flag not in ("auto", "none"):
            agent = choose_formats(flag, "none", BYTES, "X")
            assert agent.tools is not None and agent.reasoning is None
    assert choose_formats("qwen25", "deepseek-r1", BYTES, "X").tools is TOOL_FORMATS["hermes"]
    assert choose_formats("none", "none", BYTES, "Qwen3MoeForCausalLM").describe() == {
        "tool_call_parser": "none", "tool_call_parser_reason": "--tool-call-parser none",
        "reasoning_parser": "none", "reasoning_parser_reason": "--reasoning-parser none",
        "keep_special_tokens": False, "strict_tools_under_auto": "no tool-call format"}
    with pytest.raises(ValueError, match="--tool-call-parser 'llama3_json' is unknown"):
        choose_formats("llama3_json", "auto", BYTES, "X")
    with pytest.raises(ValueError, match="--reasoning-parser 'o1' is unknown"):
        choose_formats("auto", "o1", BYTES, "X")


def _checkpoint(folder: Path, template: str, special: bool) -> HFTokenizer:
    rust = _write_bpe(folder, template)
    rust.add_tokens([AddedToken("<tool_call>", special=special),
                     AddedToken("</tool_call>", special=special)])
    rust.save(str(folder / "tokenizer.json"))
    return HFTokenizer(str(folder))


def test_markers_that_are_special_tokens_are_kept(tmp_path: Path) -> None:
    plain = _checkpoint(tmp_path / "plain", "<tool_call>", special=False)
    assert not choose_formats("auto", "none", plain, "X").keep_special_tokens
    special = _checkpoint(tmp_path / "special", "<tool_call>", special=True)
    assert choose_formats("auto", "none", special, "X").keep_special_tokens


TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}"
    "{% endif %}{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{% for k, v in tc.function.arguments.items() %} {{ k }}={{ v | tojson }}{% endfor %}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")


def test_a_template_gets_tools_calls_and_kwargs_as_transformers_passes_them(
        tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from moeserve.server.agent.protocol import ChatMessage

    _write_bpe(tmp_path, TEMPLATE)
    config = tmp_path / "tokenizer_config.json"  # (transformers takes only a text pad_token)
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "pad_token": "<|endoftext|>"}))
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]
    wire: list[dict[str, Any]] = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_time", "arguments": json.dumps({"tz": "CET", "n": [1]})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    messages = [ChatMessage.model_validate(m).for_template() for m in wire]
    ours = HFTokenizer(str(tmp_path)).apply_chat_template(messages, True, tools,
                                                          enable_thinking=False)
    reference = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True,
        enable_thinking=False)
    assert ours == reference
    assert '<tool_call>get_time tz="CET" n=[1]</tool_call>' in ours and "[c1]" in ours
    assert ours.endswith("<think></think>")
