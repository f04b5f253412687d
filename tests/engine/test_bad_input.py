"""Bad input gets a clear error naming the problem, and the engine keeps serving the others.

Per-request errors are raised while other requests are in flight; those requests' outputs must
equal a run in which the bad request never came.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tiny(**kw: object) -> LLM:
    return LLM("tiny-moe", device="cpu", max_model_len=64, **kw)


def _prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(5 + 7 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def clean_outputs() -> list[list[int]]:
    return [r.token_ids for r in _tiny().generate(_prompts(), GREEDY)]


BAD_REQUESTS: dict[str, tuple[Callable[[], tuple[object, object]], str]] = {
    "prompt too long": (lambda: ([1] * 64, GREEDY), "max_model_len"),
    "token id outside vocab": (lambda: ([1, 2, 512], GREEDY), "outside the vocabulary"),
    "negative token id": (lambda: ([1, -3], GREEDY), "outside the vocabulary"),
    "empty prompt": (lambda: ([], GREEDY), "empty"),
    "max_tokens < 1": (lambda: ([1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    "temperature < 0": (lambda: ([1, 2], SamplingParams(temperature=-0.5)), "temperature"),
    "top_p < 0": (lambda: ([1, 2], SamplingParams(top_p=-0.1)), "top_p"),
    "temperature NaN": (lambda: ([1, 2], SamplingParams(temperature=float("nan"))),
                        "temperature"),
    "top_p > 1": (lambda: ([1, 2], SamplingParams(top_p=1.5)), "top_p"),
    "stop id outside vocab": (lambda: ([1, 2], SamplingParams(stop_token_ids=[9999])),
                              "stop token id"),
    "prompt of wrong type": (lambda: (3.5, GREEDY), "prompt must be"),
    "negative reasoning budget": (
        lambda: ([1, 2], SamplingParams(reasoning_budget=(3, -2, -1))),
        "reasoning_budget must be"),
    "reasoning budget's end outside vocab": (
        lambda: ([1, 2], SamplingParams(reasoning_budget=(9999, 4, -1))),
        "reasoning budget's token id 9999"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_fails_alone(case: str, clean_outputs: list[list[int]]) -> None:
    make, needle = BAD_REQUESTS[case]
    llm = _tiny()
    ids = [llm.add_request(p, GREEDY) for p in _prompts()]
    for _ in range(4):
        llm.step()
    with pytest.raises(ValueError, match=needle):
        prompt, params = make()  # SamplingParams validates on construction
        llm.add_request(prompt, params)
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.result(i).token_ids for i in ids] == clean_outputs
    llm.engine.scheduler.check_integrity()


def test_generate_with_one_bad_prompt_submits_nothing() -> None:
    llm = _tiny()
    with pytest.raises(ValueError, match="prompt 1: .*outside the vocabulary"):
        llm.generate([[1, 2, 3], [1, 99999]], GREEDY)
    assert not llm.has_unfinished_requests()


def test_chat_renders_each_conversation_through_the_template() -> None:
    llm = LLM("tiny-moe", device="cpu", max_model_len=160)
    tools = [{"type": "function", "function": {"name": "t"}}]
    history = [{"role": "user", "content": "T"},
               {"role": "assistant", "content": "x"},
               {"role": "tool", "content": "12"}]
    outs = llm.chat([history, history[:1]], GREEDY, tools=tools)
    want = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c, True, tools),
                                 add_special_tokens=False) for c in (history, history[:1])]
    assert [o.prompt_token_ids for o in outs] == want
    assert outs[1].token_ids == llm.generate([want[1]], GREEDY)[0].token_ids
    assert llm.chat(history[:1], GREEDY)[0].prompt_token_ids == llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(history[:1]), add_special_tokens=False)


def test_chat_names_the_conversation_its_template_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _tiny()

    def refuse(messages: list, *args: object, **kwargs: object) -> str:
        if messages[0]["content"] == "bad":
            raise ValueError("chat template error: roles must alternate")
        return "ok"

    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", refuse)
    ok, bad = [{"role": "user", "content": "fine"}], [{"role": "user", "content": "bad"}]
    with pytest.raises(ValueError, match="conversation 1: chat template error: roles"):
        llm.chat([ok, bad], GREEDY)
    assert not llm.has_unfinished_requests()


def test_duplicate_request_id() -> None:
    llm = _tiny()
    llm.add_request([1, 2], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([3, 4], GREEDY, request_id="a")


def test_abort_frees_blocks(clean_outputs: list[list[int]]) -> None:
    llm = _tiny()
    ids = [llm.add_request(p, GREEDY) for p in _prompts()]
    victim = llm.add_request([5] * 40, GREEDY)
    for _ in range(3):
        llm.step()
    llm.abort(victim)
    assert llm.result(victim).finish_reason.value == "abort"
    llm.engine.scheduler.check_integrity()
    while llm.has_unfinished_requests():
        llm.step()
    assert [llm.result(i).token_ids for i in ids] == clean_outputs


def test_unknown_preset_or_folder() -> None:
    with pytest.raises(ConfigError, match="neither a checkpoint folder nor a preset"):
        LLM("no-such-model", device="cpu")


def test_unknown_engine_argument() -> None:
    with pytest.raises(ConfigError, match="unknown engine argument.*max_num_seqs"):
        LLM("tiny-moe", device="cpu", max_num_seqs=4)


@pytest.mark.parametrize("edit,needle", [
    ({"architectures": ["LlamaForCausalLM"]}, "unknown architecture"),
    ({"some_new_field": 1}, "some_new_field"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization"),
    ({"sliding_window": 4096, "use_sliding_window": True}, "sliding_window"),
])
def test_config_we_cannot_serve(tmp_path: os.PathLike, edit: dict, needle: str) -> None:
    from moeserve.presets import load_preset

    hf = load_preset("tiny-moe") | edit
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=needle):
        LLM(str(tmp_path), device="cpu")


def test_checkpoint_missing_and_extra_tensor(tmp_path: os.PathLike) -> None:
    from safetensors.torch import load_file, save_file

    from tests.models.checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint("qwen3_moe", tmp_path / "ok")
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    missing = shutil.copytree(folder, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != name},
              os.path.join(missing, "model.safetensors"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        LLM(str(missing), device="cpu", dtype="float32")
    extra = shutil.copytree(folder, tmp_path / "extra")
    save_file(tensors | {"model.layers.0.mlp.bonus.weight": tensors[name].clone()},
              os.path.join(extra, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.bonus\.weight"):
        LLM(str(extra), device="cpu", dtype="float32")
