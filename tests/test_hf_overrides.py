"""`hf_overrides`: a preset or a checkpoint's config edited by a JSON object (slicing a preset
at its real widths), refused by name when malformed or when it makes an invalid config; the
engine, its capacity report, the API process and every command that builds an engine see the
overridden config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moeserve.config import ConfigError, EngineConfig, load_model_config
from moeserve.presets import load_preset
from tests.hf_published import FP8, write_checkpoint_config


def test_hf_overrides_slice_a_preset_at_its_real_widths() -> None:
    full, _ = load_model_config("deepseek-v3")
    sliced, is_preset = load_model_config("deepseek-v3", '{"num_hidden_layers": 6}')
    assert is_preset and sliced.num_layers == 6 and sliced.mlp_only_layers == (0, 1, 2)
    assert dataclasses.replace(sliced, num_layers=61) == full
    layer = (full.num_params() - sliced.num_params()) / 55
    assert 0.015 * full.num_params() < layer < 0.02 * full.num_params()  # one MoE layer, ~11B


def test_hf_overrides_apply_to_a_checkpoint_folder_and_take_a_dict(tmp_path: Path) -> None:
    folder = write_checkpoint_config(tmp_path / "flash", load_preset("glm-4.7-flash"))
    mc, _ = load_model_config(folder, {"num_hidden_layers": 4, "n_routed_experts": 16})
    assert (mc.num_layers, mc.num_experts, mc.mlp_only_layers) == (4, 16, (0,))


@pytest.mark.parametrize("value,needle", [
    ("{num_hidden_layers: 6}", "hf_overrides is not valid JSON"),
    ("", "hf_overrides is not valid JSON"),
    ("[6]", "hf_overrides must be a JSON object"),
    ("6", "hf_overrides must be a JSON object"),
    ({"num_hidden_layers": {1, 2}}, "hf_overrides must hold JSON values"),
])
def test_bad_hf_overrides_name_the_argument(value: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(model="tiny-moe", hf_overrides=value)


@pytest.mark.parametrize("override,needle", [
    ({"num_experts_per_tok": 300}, r"num_experts_per_tok 300 must be in \[1, 256\]"),
    ({"n_group": 7}, "n_group 7 must divide the 256 experts"),
    ({"brand_new_field": 1}, "brand_new_field"),
    ({"quantization_config": {**FP8, "weight_block_size": [64, 64]}},
     r"weight_block_size=\[64, 64\] is not implemented"),
])
def test_an_override_making_an_invalid_config_gives_the_parsers_error(override: dict,
                                                                       needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        load_model_config("deepseek-v3", override)
    assert "with hf_overrides" in str(e.value)


def test_engine_config_keeps_hf_overrides_as_canonical_json() -> None:
    a = EngineConfig(hf_overrides={"vocab_size": 300, "num_hidden_layers": 2})
    b = EngineConfig(hf_overrides='{"num_hidden_layers":2,"vocab_size":300}')
    assert a.hf_overrides == b.hf_overrides == '{"num_hidden_layers": 2, "vocab_size": 300}'
    assert EngineConfig().hf_overrides is None


def test_engine_and_capacity_report_use_the_overridden_config() -> None:
    from moeserve import LLM, SamplingParams

    llm = LLM("tiny-moe", device="cpu", max_model_len=64,
              hf_overrides={"num_hidden_layers": 2, "vocab_size": 300})
    mc = llm.engine.model_config
    assert (mc.num_layers, mc.vocab_size) == (2, 300)
    assert len(llm.engine.runner.model.model.layers) == 2
    report = llm.report.to_dict()
    assert report["vocab_size"] == 300 and report["num_params"] == mc.num_params()
    assert report["engine_config"]["hf_overrides"] == '{"num_hidden_layers": 2, "vocab_size": 300}'
    assert any(line.split()[:2] == ["hf", "overrides"]
               and '{"num_hidden_layers": 2, "vocab_size": 300}' in line
               for line in report["text"].splitlines())
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and all(t < 300 for t in out.token_ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 299, 300]], SamplingParams(max_tokens=1))


def test_api_process_sees_the_engines_overridden_config() -> None:
    import asyncio

    from moeserve.engine.process.async_client import AsyncEngineClient

    engine = {"model": "tiny-moe", "device": "cpu", "max_model_len": 64,
              "hf_overrides": '{"num_hidden_layers": 2, "vocab_size": 300}'}

    async def main() -> None:
        client = await AsyncEngineClient.start(engine)
        try:
            mc = client.model_config
            assert (mc.num_layers, mc.vocab_size, client.tokenizer.vocab_size) == (2, 300, 300)
            report = client.capacity_report
            assert report["vocab_size"] == 300 and report["num_params"] == mc.num_params()
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_hf_overrides_flag_on_the_commands_that_build_an_engine(
        capsys: pytest.CaptureFixture) -> None:
    from moeserve.cli import build_parser, main
    from moeserve.tune.cli import _engine_flags

    flag = '{"num_hidden_layers": 2}'
    for command in (["serve"], ["generate"]):
        args = build_parser().parse_args([*command, "--hf-overrides", flag])
        assert args.hf_overrides == flag
    # tune (and bench, which starts `moeserve serve` with --server-args) pass serve's flags on
    assert _engine_flags(f"--hf-overrides '{flag}'", "--server-args") == {"hf_overrides": flag}
    assert main(["generate", "--preset", "tiny-moe", "--device", "cpu", "--num-prompts", "1",
                 "--max-tokens", "2", "--ignore-eos", "--hf-overrides", flag]) == 0
    assert "hf overrides" in capsys.readouterr().out
    assert main(["generate", "--preset", "tiny-moe", "--device", "cpu",
                 "--hf-overrides", "num_hidden_layers=2"]) == 2
    assert "hf_overrides is not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--preset", "tiny-moe", "--device", "cpu",
                 "--hf-overrides", '{"num_experts_per_tok": 99}']) == 2
    assert "num_experts_per_tok 99" in capsys.readouterr().err
