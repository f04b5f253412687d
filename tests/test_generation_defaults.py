"""The model's sampling defaults (hf_config/generation.py): generation_config.json's fields for
what a request leaves out, in the server's requests and LLM.generate without params."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.config import ConfigError
from moeserve.hf_config.generation import sampling_defaults
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest
from moeserve.server.routes.serving import sampling_params

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
         "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
         "transformers_version": "4.51.0"}  # Qwen3-30B-A3B's generation_config.json


def _folder(tmp_path: Path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_models_fields_are_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {**QWEN3, "repetition_penalty": 1.05, "min_p": 0.0,
                                "max_new_tokens": 2048})
    assert sampling_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                         "min_p": 0.0, "repetition_penalty": 1.05,
                                         "max_tokens": 2048}
    assert sampling_defaults("tiny-moe", folder) == sampling_defaults(folder)
    assert sampling_defaults(folder, "none") == sampling_defaults(folder, "vllm") == {}
    assert sampling_defaults("tiny-moe") == {}  # a preset has no file


def test_bad_sources_and_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be auto, none or a folder"):
        sampling_defaults("tiny-moe", str(tmp_path))
    with pytest.raises(ConfigError, match="top_p = 1.5 cannot be a sampling default"):
        sampling_defaults(_folder(tmp_path, {"top_p": 1.5}))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read as JSON"):
        sampling_defaults(str(tmp_path))


def test_a_request_takes_them_where_it_is_silent() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
                "max_tokens": 100}
    silent = CompletionRequest.model_validate({"prompt": "hi"})
    p = sampling_params(silent, [[1, 2]], None, 16, None, 4096, None, defaults)[0]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (
        0.6, 0.95, 20, 1.05, 16)  # completions: OpenAI's 16 below max_new_tokens
    explicit = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0, "top_k": 0,
                                                 "top_p": 1, "repetition_penalty": 1.0})
    p = sampling_params(explicit, [[1, 2]], None, 16, None, 4096, None, defaults)[0]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 1.0, 0, 1.0)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    p = sampling_params(chat, [[1, 2]], None, None, None, 4096, None, defaults)[0]
    assert p.max_tokens == 100 and p.temperature == 0.6  # chat: max_new_tokens caps the room
    assert sampling_params(chat, [[1, 2]], None, None, None, 4096)[0].temperature == 1.0


def test_llm_generate_without_params_takes_them(tmp_path: Path) -> None:
    from moeserve import LLM, SamplingParams

    folder = _folder(tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM("tiny-moe", device="cpu", generation_config=folder)
    assert llm.default_params() == SamplingParams(temperature=0.0, max_tokens=3)
    out = llm.generate([[5, 6]])[0]
    assert len(out.token_ids) <= 3
    assert out.token_ids == llm.generate([[5, 6]], SamplingParams(
        temperature=0.0, max_tokens=3))[0].token_ids


def test_a_bad_source_fails_before_the_engine_starts(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from moeserve import LLM
    from moeserve.engine import llm as llm_module

    started = []
    monkeypatch.setattr(llm_module, "EngineCore", lambda cfg: started.append(cfg))
    with pytest.raises(ConfigError, match="must be auto, none or a folder"):
        LLM("tiny-moe", device="cpu", generation_config=str(tmp_path))
    assert not started
