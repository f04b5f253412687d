"""quant/spec.py: the quantization format a checkpoint declares, its checks and its refusals.

The configs are the published ones' quantization parts (DeepSeek-V3's FP8, a ModelOpt NVFP4
GLM release's hf_quant_config.json, Kimi K2-Thinking's compressed-tensors INT4)."""

from __future__ import annotations

import copy

import pytest

from moeserve.model_config import ConfigError
from moeserve.quant.spec import QuantSpec, flag_format, parse

FP8 = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                               "quant_method": "fp8", "weight_block_size": [128, 128]}}
NVFP4_HF_QUANT = {"producer": {"name": "modelopt", "version": "0.37.0"},
                  "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                   "group_size": 16,
                                   "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]}}
INT4 = {"quantization_config": {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                              "group_size": 32, "strategy": "group",
                                              "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}}


def test_the_three_formats_are_detected() -> None:
    assert parse({}) is None and parse({"quantization_config": None}) is None
    assert parse(FP8) == QuantSpec("fp8", block=(128, 128))
    nvfp4 = parse({}, NVFP4_HF_QUANT)
    assert nvfp4 is not None and nvfp4.format == "nvfp4" and nvfp4.group_size == 16
    assert nvfp4.kept_modules == ("lm_head", "model.layers.*.self_attn*")
    int4 = parse(INT4)
    assert int4 == QuantSpec("int4", group_size=32, kept_modules=(
        "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"))
    modelopt_in_config = {"quantization_config": {"quant_method": "modelopt",
                                                  **NVFP4_HF_QUANT["quantization"]}}
    assert parse(modelopt_in_config, NVFP4_HF_QUANT) == nvfp4


@pytest.mark.parametrize(("path", "value", "message"), [
    (("weight_block_size",), [64, 64], r"weight_block_size=\[64, 64\] is not implemented"),
    (("fmt",), "e5m2", r"quantization_config.fmt='e5m2' is not implemented"),
    (("activation_scheme",), "static", "activation_scheme='static'"),
    (("quant_method",), "awq", "quant_method 'awq' is not implemented"),
])
def test_fp8_fields_outside_the_arithmetic_are_named(path: tuple, value: object,
                                                     message: str) -> None:
    cfg = copy.deepcopy(FP8)
    cfg["quantization_config"][path[0]] = value
    with pytest.raises(ConfigError, match=message):
        parse(cfg)


def test_unknown_fp8_fields_are_refused_and_scale_fmt_is_checked() -> None:
    cfg = copy.deepcopy(FP8)
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"  # DeepSeek-V3.1+: accepted
    assert parse(cfg) == QuantSpec("fp8", block=(128, 128))
    cfg["quantization_config"]["scale_fmt"] = "e8m0fnu"
    with pytest.raises(ConfigError, match="scale_fmt='e8m0fnu' is not implemented"):
        parse(cfg)
    cfg["quantization_config"] = {**FP8["quantization_config"], "kv_cache_scheme": "fp8"}
    with pytest.raises(ConfigError, match="field.s. not implemented for fp8: kv_cache_scheme"):
        parse(cfg)


def test_per_tensor_fp8_is_refused_by_name() -> None:
    cfg = copy.deepcopy(FP8)
    del cfg["quantization_config"]["weight_block_size"]
    with pytest.raises(ConfigError, match="weight_block_size is missing: per-tensor FP8"):
        parse(cfg)


def test_nvfp4_and_int4_fields_are_checked() -> None:
    bad = copy.deepcopy(NVFP4_HF_QUANT)
    bad["quantization"]["quant_algo"] = "W4A8_AWQ"
    with pytest.raises(ConfigError, match="quant_algo='W4A8_AWQ' is not implemented"):
        parse({}, bad)
    bad["quantization"].pop("quant_algo")
    with pytest.raises(ConfigError, match="hf_quant_config.json quantization.quant_algo is "
                                          "missing"):
        parse({}, bad)
    asym = copy.deepcopy(INT4)
    asym["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ConfigError, match=r"group_0.weights.symmetric=False"):
        parse(asym)
    w4a8 = copy.deepcopy(INT4)
    w4a8["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8}
    with pytest.raises(ConfigError, match="only weight-only INT4"):
        parse(w4a8)
    mixed = copy.deepcopy(INT4)
    mixed["quantization_config"]["config_groups"]["group_1"] = {}
    with pytest.raises(ConfigError, match="exactly one group"):
        parse(mixed)


def test_the_flag_must_agree_with_the_checkpoint() -> None:
    assert flag_format("modelopt_fp4") == "nvfp4"
    assert flag_format("compressed-tensors") == "int4"
    assert parse(FP8, flag="fp8") is not None
    with pytest.raises(ConfigError, match="--quantization nvfp4 contradicts the checkpoint, "
                                          "which holds fp8 weights"):
        parse(FP8, flag="nvfp4")
    assert parse({}, flag="int4") is None  # unquantized: quantized as it loads, by the engine
    with pytest.raises(ConfigError, match="--quantization 'gptq' is not a format"):
        flag_format("gptq")
    with pytest.raises(ConfigError, match="hf_quant_config.json says nvfp4 but config.json's "
                                          "quantization_config says fp8"):
        parse(FP8, NVFP4_HF_QUANT)


def test_a_modelopt_folder_declares_nvfp4_in_hf_quant_config(tmp_path) -> None:
    """ModelOpt may declare NVFP4 only in hf_quant_config.json: the folder's config has it."""
    import json

    from moeserve.config import load_model_config
    from moeserve.presets import load_preset

    (tmp_path / "config.json").write_text(json.dumps(load_preset("glm-4.7-flash")))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(NVFP4_HF_QUANT))
    cfg = load_model_config(str(tmp_path))[0]
    assert cfg.quantization is not None and cfg.quantization.format == "nvfp4"
    assert cfg.quantization.kept_modules == ("lm_head", "model.layers.*.self_attn*")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {}}))
    with pytest.raises(ConfigError, match="quant_algo is missing"):
        load_model_config(str(tmp_path))
